"""The TensorRT-LLM 1.2.x limits and defaults a DFlash engine build is held to (docs/engine.md cites the source of
each), and the head dims DFlashAttention's kernels are built for."""

from __future__ import annotations

from dflash_trt.formats import FP8, NVFP4

REQUIRED_TRTLLM = "1.2"
# builder.build() asserts both for SpeculativeDecodingMode.EAGLE.
MAX_EAGLE_BATCH_SIZE = 512
MAX_EAGLE_DRAFT_LEN = 256
# TensorRT's ITopKLayer takes K <= 3840 (TensorRT 10 operator documentation) [read]: DFlash2's candidates per slot.
TOPK_MAX_K = 3840
GEMM_PLUGIN_CHOICES = ("auto", "float16", "bfloat16", "float32", "fp8", "nvfp4", "disable")
# GEMM plugins that only run weights quantized in the format they are named after.
QUANTIZED_GEMM_PLUGINS = (FP8, NVFP4)
# Stock spec-decoding generation runs only through XQA. Its HMMA kernels (the only ones for an fp16/bf16 KV cache,
# and the portable ones for FP8 KV) take these paged-KV block sizes; only Hopper's FP8-KV GMMA kernels also take 8.
# cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/decoderXQAImplJIT/kernelUtils.cpp, supportConfigHMMA.
# DFlashAttention takes them too (any power of two).
XQA_TOKENS_PER_BLOCK = (16, 32, 64, 128)
# Head dims DFlashAttention's kernels are instantiated for (plugins/include/dflash_trt/attentionMath.h).
DFLASH_ATTENTION_HEAD_DIMS = (32, 64, 128, 256)
# KV-cache block size: trtllm-build's plugin-config default (read in the 1.2.x sources). It is also the unit of a
# context chunk, so the smallest prefill chunk a step can carry.
TOKENS_PER_BLOCK = 32
KV_CACHE_TYPES = ("paged",)
LOGITS_DTYPES = ("float32", "float16")
# Length defaults for a model that allows them; `dflash-trt build` lowers them to what the checkpoint allows.
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_MAX_INPUT_LEN = 4096
