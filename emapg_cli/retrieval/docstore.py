"""An on-disk document store: the corpus rows of an index, read by row number through a memory map.

Two files in a folder: `docs.bin`, one UTF-8 JSON object `{"id", "contents"}` per row, newline-terminated
(the rows in index order, so `docs.bin` is itself a JSONL file), and `docs.offsets.npy`, int64 [n + 1], the
byte offset where row i starts (offsets[0] = 0, offsets[n] = the size of docs.bin). Reading row i is one
slice of the map and one `json.loads`: memory is the pages the OS keeps, never a Python list of every row.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
from pathlib import Path
from typing import Iterable, Optional

from emapg_cli.errors import UserError

DOCS_BIN = "docs.bin"
OFFSETS = "docs.offsets.npy"
_BLOCK = 1 << 16  # offsets buffered in memory before they go to the temporary offsets file


class DocStoreWriter:
    """Appends rows to a new doc store in `folder`; `finish()` publishes both files (docs.bin, then the offsets).

    Until then they are temporary files of unique names in `folder`; `abort()` (or leaving the `with` block on
    an exception) removes them. Memory: one block of offsets, whatever the row count."""

    def __init__(self, folder: Path):
        import numpy as np

        self.folder = Path(folder)
        tag = secrets.token_hex(4)
        self._bin_tmp = self.folder / f".{DOCS_BIN}.{tag}.tmp"
        self._off_tmp = self.folder / f".{OFFSETS}.{tag}.raw.tmp"
        self._bin = open(self._bin_tmp, "xb")
        self._raw = open(self._off_tmp, "xb")  # int64 little-endian offsets, the .npy body
        self._np = np
        self._block: list[int] = [0]
        self.rows, self.bytes = 0, 0

    def add(self, row: dict) -> None:
        """Append one `{"id", "contents"}` row (other keys are dropped)."""
        line = json.dumps({"id": str(row["id"]), "contents": str(row["contents"])}, ensure_ascii=False).encode("utf-8") + b"\n"
        self._bin.write(line)
        self.bytes += len(line)
        self.rows += 1
        self._block.append(self.bytes)
        if len(self._block) >= _BLOCK:
            self._flush()

    def _flush(self) -> None:
        self._raw.write(self._np.asarray(self._block, dtype="<i8").tobytes())
        self._block = []

    def finish(self) -> int:
        """Write `docs.offsets.npy` (header + the raw offsets) and rename both files into place; returns the row count."""
        np = self._np
        self._flush()
        self._raw.close()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        off_tmp = self.folder / f".{OFFSETS}.{secrets.token_hex(4)}.tmp"
        try:
            with open(off_tmp, "xb") as out, open(self._off_tmp, "rb") as raw:
                np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False, "shape": (self.rows + 1,)})
                for chunk in iter(lambda: raw.read(1 << 22), b""):
                    out.write(chunk)
            os.replace(self._bin_tmp, self.folder / DOCS_BIN)
            os.replace(off_tmp, self.folder / OFFSETS)  # the offsets last: a store without them does not open
        finally:
            off_tmp.unlink(missing_ok=True)
            self._off_tmp.unlink(missing_ok=True)
            self._bin_tmp.unlink(missing_ok=True)
        return self.rows

    def abort(self) -> None:
        """Close and remove the temporary files."""
        for f in (self._bin, self._raw):
            f.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._off_tmp.unlink(missing_ok=True)

    def __enter__(self) -> "DocStoreWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()


def write_docstore(rows: Iterable[dict], folder: Path) -> int:
    """Write `rows` (`{"id", "contents"}` dicts, consumed one at a time) as a doc store in `folder`; returns the
    row count. Atomic: both files appear only when every row is written (an exception leaves neither)."""
    with DocStoreWriter(folder) as w:
        for row in rows:
            w.add(row)
        return w.finish()


class DocStore:
    """Read-only, memory-mapped rows of a doc store folder: `store[i] -> {"id", "contents"}`."""

    def __init__(self, folder: Path, offsets, data: Optional[mmap.mmap], size: int):
        self.folder, self.offsets, self._data, self._size = folder, offsets, data, size

    @classmethod
    def open(cls, folder: Path) -> "DocStore":
        """The store in `folder`; a missing or inconsistent file is a one-line UserError naming it."""
        import numpy as np

        folder = Path(folder)
        try:
            offsets = np.load(folder / OFFSETS, mmap_mode="r", allow_pickle=False)  # int64 [n + 1]
        except FileNotFoundError:
            raise UserError(f"{folder}: {OFFSETS} is missing") from None
        except (OSError, ValueError) as e:
            raise UserError(f"{folder}: {OFFSETS} is not a readable .npy file ({str(e).splitlines()[0][:120]})") from None
        path = folder / DOCS_BIN
        if not path.is_file():
            raise UserError(f"{folder}: {DOCS_BIN} is missing")
        size = path.stat().st_size
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 1:
            raise UserError(f"{folder}: {OFFSETS} is not a 1-D int64 array")
        if int(offsets[0]) != 0 or int(offsets[-1]) != size:
            raise UserError(f"{folder}: {OFFSETS} ends at byte {int(offsets[-1]):,}, {DOCS_BIN} has {size:,} bytes")
        for s in range(0, len(offsets) - 1, 1 << 22):  # increasing, checked in blocks (no [n] temporary)
            part = np.asarray(offsets[s:s + (1 << 22) + 1])
            if (part[1:] <= part[:-1]).any():
                raise UserError(f"{folder}: {OFFSETS} is not increasing near row {s + 1}")
        data = None
        if size:
            with open(path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls(folder, offsets, data, size)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, str]:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} of a doc store of {n} rows")
        raw = self._data[int(self.offsets[i]):int(self.offsets[i + 1])]
        try:
            row = json.loads(raw)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("contents"), str):
            raise UserError(f"{self.folder}: {DOCS_BIN} row {i + 1} is not {{\"id\": str, \"contents\": str}}")
        return row

    def get_many(self, rows: list[int]) -> list[dict[str, str]]:
        """`[store[i] for i in rows]`."""
        return [self[i] for i in rows]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def close(self) -> None:
        """Release the memory maps (rows read earlier stay valid: they are copies)."""
        if self._data is not None:
            self._data.close()
            self._data = None
        self.offsets = None
