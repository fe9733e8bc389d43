"""Cost-Aware GRPO training script (a thin wrapper around `trl_costaware.scripts.train.main`).

    python examples/train_cost_aware_grpo.py --config examples/recipes/embedded_default.yaml
    accelerate launch examples/train_cost_aware_grpo.py --config examples/recipes/qwen2.5-0.5b-gsm8k-lora.yaml

Any `CostAwareGRPOConfig`, `ModelConfig` or script argument can be given on the command line, where it overrides the
YAML file: ``--model_name_or_path``, ``--dataset_name``, ``--reward_funcs``, ``--cost_aware false``, ...
Same as ``trl-costaware train ...``.
"""

from trl_costaware.scripts.train import main

if __name__ == "__main__":
    main()
