"""Planning beside the seed's scheduler: what a run will cost before it runs.

memory_plan  host and GPU bytes a model and its optimizer will take, checked before pinning
one_device   the rules a plan follows on a single CUDA device (group by size, widen the tail)
"""
