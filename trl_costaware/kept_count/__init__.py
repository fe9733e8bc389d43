"""The kept-count rules: how many rows m the row stage keeps per generation batch (a fixed fraction, a token budget,
``"auto"`` from a variance bound, ``"compute"`` from the measured noise scale and phase times). Pure functions over
gathered scalars, plus the step signals the ``"compute"`` rule reads from the optimizer step."""
