"""The one compiled part of kvgate: ``gateway.kv._native`` (gateway/kv/native/index.c), the KV indexer's
per-block work and the chained keys of a request's token blocks (``chain``), with BLAKE3's portable C
implementation (gateway/kv/native/blake3, CC0 / Apache-2.0). Everything else is in pyproject.toml.
BLAKE3's SIMD variants are left out: a block's key hashes 144 bytes, one chunk, which the portable code
hashes as fast (SIMD helps many chunks at once)."""

from setuptools import Extension, setup

BLAKE3 = "gateway/kv/native/blake3"

setup(
    ext_modules=[
        Extension(
            "gateway.kv._native",
            sources=[
                "gateway/kv/native/index.c",
                f"{BLAKE3}/blake3.c",
                f"{BLAKE3}/blake3_dispatch.c",
                f"{BLAKE3}/blake3_portable.c",
            ],
            include_dirs=["gateway/kv/native"],
            define_macros=[
                (name, "1")
                for name in ("BLAKE3_NO_SSE2", "BLAKE3_NO_SSE41", "BLAKE3_NO_AVX2", "BLAKE3_NO_AVX512")
            ]
            + [("BLAKE3_USE_NEON", "0")],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
