"""The adaptive-verify planner: confidence → survival → budget → `verify_lens` (docs/planner.md).

`survival` turns the draft's confidence logits into survival, `budget` chooses how many rows a
step verifies and allocates them, `cost_models` prices a step, and `verify_plan` holds the plan
a generated package configures for its verify mode.
"""
