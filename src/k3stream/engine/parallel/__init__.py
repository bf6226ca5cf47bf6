"""Tensor and expert parallelism over a torch.distributed process group (started by `torchrun`).

`groups` starts the process group; `tensor` and `experts` slice and wrap a loaded model from outside;
`runner` lets rank 0 drive the model while the other ranks follow its steps.
"""

# how long a rank waits in one collective for the others (a stopped peer); a dead one is seen at once
DEFAULT_TIMEOUT_S = 20.0
