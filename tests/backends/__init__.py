"""The fast paths (dcmha.backends): compiled CPU kernels, torch_native, Triton, Pallas, XLA; test_gpu_* need a GPU."""
