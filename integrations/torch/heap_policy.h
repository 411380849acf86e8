#pragma once
// How glibc's malloc treats the free heap of a training process, set by the wrapper constructed last
// (the settings are the process's, not a wrapper's): DDP keeps it resident between steps
// (DDPOptions::keep_heap_resident), FSDP maps its large blocks on their own (FSDPOptions::
// mmap_threshold_bytes), which only works while the top of the heap is trimmed, so that a large block
// does not simply come out of a resident top. No-ops without glibc.
namespace cohort::torch::heap_policy {

// glibc's own trimming off, its mmap threshold fixed at 32 MiB (DDP).
void keep_resident();
// Trimming as glibc's default (M_TRIM_THRESHOLD 128 KiB) and the top handed back now, if keep_resident
// turned it off in this process (FSDP); otherwise nothing.
void trim_again();

}  // namespace cohort::torch::heap_policy
