"""TEST-ONLY stand-in for sgl_kernel's CPU ops (PyPI's sgl_kernel is CUDA-only); see ../README.md."""


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Torch version of SGLang's assign_req_to_token_pool: request r's token slots
    [start, end) are the next (end - start) entries of out_cache_loc."""
    off = 0
    for i in range(req_pool_indices.shape[0]):
        start, end, row = int(start_offset[i]), int(end_offset[i]), int(req_pool_indices[i])
        if end > start:
            req_to_token[row, start:end] = out_cache_loc[off:off + end - start].to(req_to_token.dtype)
        off += end - start


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"test-only sgl_kernel stand-in: {name} is not available on CPU")

    missing.__name__ = name
    return missing
