"""cp_rope.launch: torchrun entry points for long-context pretraining."""
