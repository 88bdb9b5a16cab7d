"""`dspark simulate`: trace-driven replay of verify policies against the planner (docs/planner.md).

A recording in which every row ran (`trace`) gives, per request-step, the draft's confidence and the
uncapped match; each policy (`policies`: static, every fixed verify length, the deployment's adaptive
planner, the oracle) decides the step's `verify_lens`, commits `min(raw_correct_len, verify_len - 1) + 1`
tokens per request, and is charged the cost table's step time (`pricing`). `sweep` forms steps of c
request-steps per concurrency; `run_replay` replays a recorded run's own requests to completion, for
comparing predictions with measured runs; `output` and `plot` present the results.
"""
