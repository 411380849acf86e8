"""cohort's Python helpers: `python3 -m cohort.launch` (torch.distributed.launch's line, run by cohort).

The backend and the parameter-server client are the top-level modules cohort_torch and cohort_ps.
"""
