"""Pack what a lent GPU machine lacks into ``.device/`` (git-ignored), to carry with a run.

The device image has PyTorch, Triton, transformers and tokenizers, but not every package
tokenmill imports, and nothing can be installed there from a registry. Each carried call is
limited to 64 MiB, which is less than the embedded model (94 MiB), so this writes:

- ``.device/whl/``: wheels (CPython 3.12, manylinux) of the missing pure dependencies;
- ``.device/vocab.gguf``: the embedded model's metadata and tokenizer without tensors, which is
  all that dummy-weight presets read from it (a few MB);
- ``.device/part1/gguf.part``, ``.device/part2/gguf.part``: the embedded GGUF in two halves,
  carried by two calls in a row to one warm machine and joined there by device_setup.sh.

    python benchmarks/gpu/pack_device.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf

from tokenmill.model_loader.gguf import embedded_model_path

OUT = ".device"
# Imported by tokenmill but absent from the device image (its package list, KINDS.md).
WHEELS = ["gguf==0.19.0", "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0",
          "typing-inspection==0.4.2", "typing-extensions==4.15.0",
          # structured outputs (grammars' token bitmasks), and the FFI library it loads
          "xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2",
          # the server (tests/gpu/test_server_cuda.py); fastapi imports opentelemetry's API
          "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "python-multipart==0.0.34",
          "platformdirs==4.14.8", "annotated-doc==0.0.7", "opentelemetry-api==1.45.2",
          # the GPU's energy counter (NVML through Zeus): joules a request in the results
          "zeus==0.16.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def download_wheels(folder: str) -> None:
    """CPython 3.12 manylinux wheels of WHEELS, without their dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", folder]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + WHEELS, check=True)


def write_vocab_gguf(src: str, dst: str) -> None:
    """Copy every key/value field of ``src`` (tokenizer included) into ``dst``, no tensors."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def split_file(src: str, parts: list[str]) -> None:
    """Cut ``src`` into len(parts) pieces of (nearly) equal size."""
    size = os.path.getsize(src)
    step = -(-size // len(parts))
    with open(src, "rb") as f:
        for path in parts:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                out.write(f.read(step))


def main() -> None:
    src = embedded_model_path()
    os.makedirs(OUT, exist_ok=True)
    download_wheels(os.path.join(OUT, "whl"))
    write_vocab_gguf(src, os.path.join(OUT, "vocab.gguf"))
    split_file(src, [os.path.join(OUT, "part1", "gguf.part"), os.path.join(OUT, "part2", "gguf.part")])
    for root, _dirs, files in os.walk(OUT):
        for name in sorted(files):
            path = os.path.join(root, name)
            print(f"{os.path.getsize(path) / 2**20:8.2f} MiB  {path}")


if __name__ == "__main__":
    main()
