"""TEST-ONLY shims that let SGLang 0.5.23's CPU engine run HiCache here (see README.md)."""

import importlib.abc
import importlib.machinery
import sys

import torch

# 1. torchvision (a CUDA build): declare the op schemas its Python side registers fakes for.
for _op in ("nms", "qnms"):
    try:
        torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined (a real torchvision loaded first)
        pass


# 3. HiCache's host pool on "cpu". Zeroed, so that it is resident from the start as SGLang's
# pinned (cudaHostRegister'd) host pool is on a GPU host: left untouched, a fresh engine's first
# loads took a page fault per 4 KiB of pool they wrote (65 MB of pages: 15 ms against 5 ms).
def _alloc_cpu(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    return torch.zeros(dims, dtype=dtype, device="cpu")


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src, dst = src_indices.to(torch.long), dst_indices.to(torch.long)
    for s, d in zip(src_layers, dst_layers):
        d[dst] = s[src].to(d.dtype)


def _patch(name, module):
    if name == "sglang.srt.mem_cache.pool_host.common":
        module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_cpu
    else:
        module.transfer_kv_direct = _transfer_kv_direct
        # 4. (only SGLang's own `file` backend, for the bench's comparison) its legacy page path
        # allocates a pinned bounce page, which needs an accelerator: the same page, unpinned.
        pool = module.MHATokenToKVPoolHost

        def get_dummy_flat_data_page(self):
            return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                               dtype=self.dtype, device=self.device).flatten()

        pool.get_dummy_flat_data_page = get_dummy_flat_data_page


_TARGETS = {"sglang.srt.mem_cache.pool_host.common", "sglang.srt.mem_cache.pool_host.mha"}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module, _run=run, _name=fullname):
            _run(module)
            _patch(_name, module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
if not hasattr(torch.cpu.Stream, "synchronize"):
    torch.cpu.Stream.synchronize = lambda self: None
