"""The CUDA runtime: specchat's own forward for Llama-family targets on an NVIDIA GPU.

A static KV cache allocated at load, every forward after the prompt padded to one width and
replayed as a CUDA graph, and Triton kernels whose rows never depend on one another: the NF4
matmul (bitsandbytes' weights, read once per block for all rows), the bf16 matmul of the LM
head, the RMS norm and the attention (fixed key blocks, one sequential pass). A token's logits
are therefore the same bits whether it was fed alone, in a verify or in a prompt page
(`runner.CudaRunner`, proved at load by `models.runtime.prove_row_exact`).

Nothing here is imported on a machine without CUDA except by the tests, which run the same
kernels under `TRITON_INTERPRET=1` on the CPU at tiny shapes.
"""
