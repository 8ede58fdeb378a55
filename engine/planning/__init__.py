"""Planning beside the seed's scheduler: what a run will cost before it runs.

gpu_memory   the GPU memory cap (max_gpu_memory, RP_GPU_MEMORY_GIB) parsed, and the floor
             it must clear (the largest layer with its gradients)
memory_plan  host and GPU bytes a model and its optimizer will take, checked before pinning
one_device   the rules a plan follows on a single CUDA device (group by size, widen the tail)
search       layer groups from measured layer times, tuned on the simulation (ModelExecutePlan.auto)
simulate     the round-robin pipeline simulated from per-job costs: a plan's call time
"""
