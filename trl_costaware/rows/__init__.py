"""The row stage (after generation): which rollouts of a scored generation batch train, with what weight, and in what
micro-batch shape. `plan.plan_batch` is the one decision per generation batch; `sampling` supplies its m."""
