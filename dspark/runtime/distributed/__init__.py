"""Running one deployment over several processes (torch.distributed).

`tensor_parallel` splits a dense target's weights across ranks and runs its forward with collectives;
the launch and the step protocol between the ranks live beside it. Nothing is imported here, so
importing one submodule costs only what that submodule needs.
"""
