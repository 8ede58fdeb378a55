"""What makes a step faster without changing its arithmetic: decoder layers replayed as CUDA
graphs (graphs) and double-buffered half-precision host weights (weight_buffers).
"""
