"""ebpf: see shared design; filled in by its own issue."""
