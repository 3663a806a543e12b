"""From a spec to arrays: model specs, GGUF and its quant kernels, the weights-only pickle reader, safetensors
weights, shipped and fetched assets, a target's identity card, the ShareGPT data."""
