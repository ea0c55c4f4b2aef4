"""Drafting runtime: the drafter, its persistent buffers, batch layout, KV pages, slot state, trees."""
