"""Atomic writes (temp file + rename), hashing and checksummed directories, shared by every stage that writes
artifacts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)
CHECKSUMS = "checksums.json"


def _default_mode(path: Path, base: int) -> None:
    """mkstemp/mkdtemp make owner-only entries; give the final one the mode a plain create would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, base & ~umask)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it over `path`, on failure remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        _default_mode(Path(tmp), 0o666)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_table(path: str | os.PathLike, rows: list[str]) -> None:
    """A markdown table (or any lines) written atomically, then printed with where it went: the scripts' results."""
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"table: {path}")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


class JsonlError(ValueError):
    """A JSON-lines file holds a line that is not UTF-8 JSON; the message names the file and the line."""


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every non-blank line of `path` as JSON (a UTF-8 byte-order mark is skipped)."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                if line.strip():
                    rows.append(json.loads(line))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise JsonlError(f"{path}, line {line_no}: not a UTF-8 JSON line ({err})") from err
    return rows


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class CorruptFile(ValueError):
    """A file differs from the checksum recorded when it was written, or is missing or unreadable; the message
    names it."""


def write_checksums(directory: str | os.PathLike) -> None:
    """Record the sha256 of every file under `directory` in its checksums.json (call it once the rest is written)."""
    directory = Path(directory)
    sums = {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS}
    write_json(directory / CHECKSUMS, sums)


def verify_checksums(directory: str | os.PathLike) -> None:
    """Raise CorruptFile naming the first file under `directory` that is missing or differs from its recorded
    sha256; without its checksums (written last) the directory was never finished."""
    directory = Path(directory)
    if not (directory / CHECKSUMS).exists():
        raise CorruptFile(f"{directory}: no {CHECKSUMS}, so it was never written whole")
    try:
        sums = json.loads((directory / CHECKSUMS).read_text())
    except ValueError as err:  # bad UTF-8 or bad JSON
        raise CorruptFile(f"{directory / CHECKSUMS}: unreadable ({err})") from err
    for name, want in sums.items():
        path = directory / name
        if not path.is_file():
            raise CorruptFile(f"{path}: missing (listed in {directory / CHECKSUMS})")
        found = sha256_file(path)
        if found != want:
            raise CorruptFile(f"{path}: sha256 {found[:12]}..., {CHECKSUMS} records {want[:12]}... (corrupted or "
                              "rewritten since it was saved)")


def weights_fingerprint(model: torch.nn.Module, head: int = 256) -> str:
    """sha256 over every parameter's name, shape and first `head` values: cheap even for a 70B target, and
    it tells apart weights re-saved under the same name (a fine-tuned local dir, another random seed)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(param.detach().reshape(-1)[:head].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def embedding_fingerprint(weight_VD: torch.Tensor, rows: int = 4096) -> str:
    """sha256 over an embedding's shape and every value (as float32, `rows` rows at a time, so memory stays small):
    what tells a head's target apart from another with the same shapes (a fine-tune, another random seed)."""
    digest = hashlib.sha256(str(tuple(weight_VD.shape)).encode())
    for start in range(0, weight_VD.shape[0], rows):
        digest.update(weight_VD[start:start + rows].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp dir beside `path`; on success it replaces `path` whole, on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        _default_mode(tmp, 0o777)
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
