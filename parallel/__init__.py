"""cp_rope.parallel: packing, the zigzag CP split, CP attention and the CP-aware loss."""
