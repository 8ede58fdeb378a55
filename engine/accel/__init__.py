"""What makes a step faster: decoder layers replayed as CUDA graphs (graphs) and
double-buffered half-precision host weights (weight_buffers), without changing its
arithmetic; and, by choice, linear layers multiplied in float8 (fp8).
"""
