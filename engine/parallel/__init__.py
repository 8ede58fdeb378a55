"""Beyond one process: data parallel over torch.distributed (data_parallel) and the full
checkpoints of masters and optimizer state that any number of ranks can load (checkpoint).
"""
