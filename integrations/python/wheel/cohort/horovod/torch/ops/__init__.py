"""cohort's Horovod operations, one module per idea; `cohort.horovod.torch.mpi_ops` is their public face
(Horovod's import surface), and its docstring lists the modules."""
