"""What runs the graph, behind `kvedge.runtime.interface.Backend`: onnxruntime (`ort`: CPU, or
CUDA with the cache pool mapped), a TensorRT engine (`trt`), and the memory they give the cache
pool (`memory`: host pages; `cuda`: pinned host memory mapped for the GPU, or device memory).
`kvedge.runtime.registry` chooses one by `RunOptions.device`."""
