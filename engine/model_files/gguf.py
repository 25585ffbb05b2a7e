"""The one reader of the GGUF container: header metadata, tensor directory, raw tensor bytes.

The weights loader (`engine.loader.gguf`) and the tokenizer (`engine.model_files.vocab`,
through `read_gguf_metadata`) both read GGUF files here; numpy, no torch.

`gguf.GGUFReader` builds a numpy view per array element, which costs ~2 s on the
49k-token vocabulary of SmolLM2 before any weight is touched; this reader walks the
same layout with `struct` in ~0.1 s and memory-maps the tensor data. Dequantization
stays with the `gguf` package (`gguf.quants`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.model_files.errors import CheckpointError, CheckpointNotFoundError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory. `shape` is in torch (row-major) order, ggml's ne reversed."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw uint8 data as `gguf.quants.dequantize` expects it (rows of blocks)."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        rows = self.shape[:-1] if self.shape else ()
        cols = self.shape[-1] if self.shape else 1
        return (*rows, cols // block_size * type_size)


class _Cursor:
    """Sequential little-endian reads over a buffer, raising CheckpointError past its end."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF file (read past end at byte {start})"
            )
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            size = struct.calcsize(fmt)
            raw = struct.unpack_from(fmt, self.buf, self.take(size))[0]
            # float32 metadata (eps, rope theta) reads back as e.g. 9.999999747e-06; keep the
            # shortest decimal that round-trips in float32 (1e-05), as written in config.json.
            return float(str(np.float32(raw))) if vtype == GGUFValueType.FLOAT32 else raw
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            itype = self.u32()
            count = self.u64()
            dtype = _NUMPY_DTYPES.get(itype)
            if dtype is not None:
                nbytes = count * np.dtype(dtype).itemsize
                return np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.take(nbytes)).copy()
            if count > self.size:
                raise CheckpointError(f"{self.path}: corrupt GGUF metadata (array of {count} items)")
            if itype == GGUFValueType.STRING:  # vocabularies and merges: ~50k strings each
                return [self.string() for _ in range(count)]
            return [self.value(itype) for _ in range(count)]
        raise CheckpointError(f"{self.path}: corrupt GGUF metadata (unknown value type {vtype})")


class GGUFFile:
    """An open GGUF file: metadata, tensor directory, and zero-copy access to tensor bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as f:
            try:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as err:  # empty file
                raise CheckpointError(f"{self.path}: not a GGUF file (empty)") from err
        try:
            self._parse()
        except (struct.error, OverflowError, ValueError) as err:
            self.close()
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"{self.path}: corrupt GGUF file ({err})") from err

    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.path)
        if self._mmap[:4] != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic {bytes(self._mmap[:4])!r})")
        cur.take(4)
        self.version = cur.u32()
        if self.version & 0xFFFF == 0:
            raise CheckpointError(f"{self.path}: big-endian GGUF files are not supported")
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {self.version} is not supported (need 2 or 3)")
        n_tensors = cur.u64()
        n_kv = cur.u64()
        # Each KV pair and tensor entry takes at least 12 bytes: reject garbage counts early.
        if (n_tensors + n_kv) * 12 > cur.size:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)"
            )
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())
        entries = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise CheckpointError(f"{self.path}: corrupt tensor entry {name!r} ({n_dims} dims)")
            ne = [cur.u64() for _ in range(n_dims)]
            raw_type = cur.u32()
            entries.append((name, ne, raw_type, cur.u64()))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: invalid general.alignment {alignment}")
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, raw_type, rel in entries:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has unknown GGML type id {raw_type}"
                ) from None
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(ne, dtype=np.int64)) if ne else 1
            if ne and ne[0] % block_size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} row length {ne[0]} is not a multiple of the "
                    f"{qtype.name} block size {block_size}"
                )
            info = GGUFTensorInfo(
                name=name,
                qtype=qtype,
                shape=tuple(reversed(ne)),
                offset=self.data_offset + rel,
                nbytes=n_elements // block_size * type_size,
            )
            if info.offset + info.nbytes > cur.size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} lies past the end of the file (truncated download?)"
                )
            if name in self.tensors:
                raise CheckpointError(f"{self.path}: duplicate tensor {name!r}")
            self.tensors[name] = info

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of `info.byte_shape` (a view of the file)."""
        data = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(info.byte_shape)

    def close(self) -> None:
        """Release the mapping; arrays from `raw` must not be used afterwards."""
        try:
            self._mmap.close()
        except BufferError:
            # numpy views still reference the map; it is released when they are collected.
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key-value metadata as plain Python values (arrays become lists)."""
    with GGUFFile(path) as gguf_file:
        return {
            key: value.tolist() if isinstance(value, np.ndarray) else value
            for key, value in gguf_file.metadata.items()
        }
