"""Round checkpoints of the server: tensors in safetensors, metadata in JSON, written atomically.

Every round the Flower server saves everything a resumed run needs: the aggregator's flat
`state_dict()` (`param/...`, `outer/...`, `proj/...`, `moment/...`, `counter/round`,
`counter/opt_step`), the RNG states (`rng_state()`), and JSON metadata (config, round, model id,
metrics so far). One checkpoint is a pair of files in one directory:

    round_00012.safetensors   the tensors
    round_00012.json          {"format": "lordo_fed.checkpoint.v1", "round": 12,
                               "tensors_file": "round_00012.safetensors",
                               "tensors_sha256": "...", "tensors_bytes": ..., "meta": {...}}
    latest.json               {"format": "lordo_fed.checkpoint.latest.v1", "round": 12,
                               "checkpoint": "round_00012.json", "run_uid": "3f2a..."}

`meta["run_uid"]` names the run a checkpoint belongs to (made when a run starts fresh, kept when it
resumes). A directory is one run's: when the checkpoint `latest.json` names is damaged, the loader
falls back only to an older checkpoint *of the same run*, never to another run's that happens to be
in the directory (docs/operations.md, "Resume").

Why it is written the way it is: a run can be killed at any instant (preemption, OOM, Ctrl-C),
including in the middle of a save, and the next start must never load a half-written checkpoint
nor lose one that was complete. Hence

* each file is written to a temporary file in the same directory, fsync'ed, then moved into
  place with `os.replace` (atomic on POSIX and Windows): a reader sees the old file or the new
  one, never a prefix;
* the safetensors file goes first and the JSON last, and the JSON records the sha256 and size
  of the tensors it belongs to: a JSON only ever exists once its tensors are complete, and a
  pair that does not match (truncated, modified, or from two different saves) is refused;
* `latest.json` is updated after the pair and older checkpoints are pruned only after that, so
  at every instant the directory holds at least one complete checkpoint that `latest.json`
  (or, failing it, a directory scan) leads to.

A safetensors file without its JSON, or a leftover `*.tmp`, is what a crash mid-save leaves
behind; loading a directory ignores both and returns the newest *complete* checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger(__name__)

FORMAT = "lordo_fed.checkpoint.v1"
LATEST_FORMAT = "lordo_fed.checkpoint.latest.v1"
LATEST_NAME = "latest.json"
RUN_KEY = "run_uid"
"""The meta key (and latest.json key) naming the run a checkpoint belongs to."""
RNG_KEYS = ("rng/torch", "rng/numpy", "rng/python")
CUDA_RNG_KEY = "rng/cuda"

_ROUND_RE = re.compile(r"^round_(\d+)\.(json|safetensors)$")
# temp files this module creates: ".<final name>.<random hex>.tmp"
_TEMP_RE = re.compile(r"^\.(round_\d+\.(json|safetensors)|latest\.json)\.[0-9a-f]+\.tmp$")
_HASH_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (or a run it does not belong to); the message names the file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file or directory does not exist (catchable as FileNotFoundError too)."""


# ----------------------------------------------------------------------------- names


def checkpoint_stem(round_idx: int) -> str:
    """`round_00012`: zero-padded so that directory listings sort by round up to 99999."""
    return f"round_{round_idx:05d}"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(round, JSON path) of every checkpoint JSON in `directory`, oldest first.

    Only JSONs count: a safetensors file without its JSON is an unfinished save. Nothing is
    verified here; `load_checkpoint` does that.
    """
    directory = Path(directory)
    found = []
    for entry in directory.iterdir():
        m = _ROUND_RE.match(entry.name)
        if m and m.group(2) == "json" and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


# ----------------------------------------------------------------------------- save


def save_checkpoint(directory: str | Path, round_idx: int, tensors: Mapping[str, Tensor], meta: dict,
                    keep: int | None = 2) -> Path:
    """Write checkpoint `round_idx` into `directory` atomically and prune older ones; returns the JSON path.

    Order (each step atomic via temp file + fsync + os.replace): tensors, then the JSON that
    vouches for them (sha256, size), then `latest.json`, then pruning. A crash at any point leaves
    the previous complete checkpoint loadable; nothing already trained is lost.

    Args:
        directory: created if missing.
        round_idx: non-negative round number; names the files (`round_<NNNNN>.*`). Saving the same
            round again replaces that checkpoint.
        tensors: name -> tensor (any device, dtype safetensors supports; made contiguous CPU
            copies where needed, storage-sharing tensors are cloned).
        meta: JSON-serialisable metadata (tuples come back as lists). Serialised before anything
            is written, so bad metadata fails without touching the directory.
        keep: how many checkpoints to keep, the one just written included (None: keep all).
            Only checkpoints of rounds *older* than `round_idx` are pruned: a newer one left by an
            earlier run in the same directory is never deleted by saving an older round.
    """
    if isinstance(round_idx, bool) or not isinstance(round_idx, int) or round_idx < 0:
        raise ValueError(f"round_idx={round_idx!r}: expected a non-negative integer")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: expected a positive integer or None (keep all)")
    if not isinstance(meta, dict):
        raise TypeError(f"meta: expected a dict, got {type(meta).__name__}")
    try:
        meta_json = json.loads(json.dumps(meta))  # fail early; also the form that will be read back
    except (TypeError, ValueError) as err:
        raise TypeError(f"meta is not JSON-serialisable: {err}") from err
    cpu = _cpu_tensors(tensors)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = checkpoint_stem(round_idx)
    tensors_path = directory / f"{stem}.safetensors"
    json_path = directory / f"{stem}.json"

    # 1. tensors
    tmp = _temp_path(tensors_path)
    try:
        save_file(cpu, str(tmp), metadata={"format": FORMAT, "round": str(round_idx)})
        _fsync_file(tmp)
        sha, size = _sha256(tmp)
        os.replace(tmp, tensors_path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(directory)

    # 2. the JSON that vouches for them
    record = {"format": FORMAT, "round": round_idx, "tensors_file": tensors_path.name,
              "tensors_sha256": sha, "tensors_bytes": size, "meta": meta_json}
    _write_text_atomic(json_path, json.dumps(record, indent=1) + "\n")

    # 3. latest.json
    latest = {"format": LATEST_FORMAT, "round": round_idx, "checkpoint": json_path.name,
              **({RUN_KEY: meta_json[RUN_KEY]} if meta_json.get(RUN_KEY) else {})}
    _write_text_atomic(directory / LATEST_NAME, json.dumps(latest, indent=1) + "\n")

    # 4. prune
    if keep is not None:
        _prune(directory, round_idx, keep)
    _remove_stale_temps(directory)
    return json_path


def _cpu_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors that safetensors accepts: no two share storage."""
    out: dict[str, Tensor] = {}
    seen_storage: set[tuple[str, int]] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor name {name!r}: expected a string")
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        if t.numel() > 0:
            key = (str(t.device), t.untyped_storage().data_ptr())
            if key in seen_storage or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # shared or a view into a larger buffer: safetensors refuses those
            seen_storage.add((str(t.device), t.untyped_storage().data_ptr()))
        out[name] = t
    return out


def _prune(directory: Path, written: int, keep: int) -> None:
    rounds: dict[int, list[Path]] = {}
    for entry in directory.iterdir():
        m = _ROUND_RE.match(entry.name)
        if m:
            rounds.setdefault(int(m.group(1)), []).append(entry)
    older = sorted((r for r in rounds if r < written), reverse=True)
    for r in older[keep - 1:]:
        # JSON first: a crash mid-prune leaves at worst an orphan safetensors (ignored), never a
        # JSON whose tensors are gone.
        for path in sorted(rounds[r], key=lambda p: p.suffix != ".json"):
            _unlink_quietly(path)
        log.debug("pruned checkpoint round %d in %s", r, directory)


def _remove_stale_temps(directory: Path) -> None:
    """Temp files of this module left by a crashed save (ours of this save are already renamed)."""
    for entry in directory.iterdir():
        if _TEMP_RE.match(entry.name):
            _unlink_quietly(entry)


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = _temp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "r+b") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable (POSIX); not possible on every platform, harmless to skip there."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# ----------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict]:
    """Load a verified checkpoint: (tensors on CPU, meta).

    `path` may be
      * a checkpoint JSON (`round_00012.json`),
      * its tensors file (`round_00012.safetensors`; the JSON next to it is required: without it the
        save never finished),
      * `latest.json` or a directory: the checkpoint `latest.json` names; if it is missing, corrupt,
        or names a checkpoint that fails verification, the newest complete checkpoint found by
        scanning (a warning is logged). Orphan tensors and `*.tmp` files are ignored.

    Raises CheckpointError (a ValueError; CheckpointNotFoundError, also a FileNotFoundError, for a
    missing path) naming the file and the problem: unreadable/corrupt JSON, wrong format, tensors
    file missing, size or sha256 mismatch (cut off mid-write or modified), unparsable safetensors.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path}: no such file or directory")
    if path.is_dir():
        return _load_directory(path)
    if path.name == LATEST_NAME:
        return _load_directory(path.parent)
    if path.suffix == ".safetensors":
        json_path = path.with_suffix(".json")
        if not json_path.exists():
            raise CheckpointError(f"checkpoint {path}: no {json_path.name} next to it; a tensors file without "
                                  f"its JSON is a save that never finished (the run stopped mid-write)")
        tensors, meta, record = _load_pair(json_path)
        if Path(record["tensors_file"]).name != path.name:
            raise CheckpointError(f"checkpoint {json_path}: belongs to {record['tensors_file']}, not {path.name}")
        return tensors, meta
    tensors, meta, _ = _load_pair(path)
    return tensors, meta


def _load_directory(directory: Path) -> tuple[dict[str, Tensor], dict]:
    problems: list[str] = []
    tried: set[Path] = set()
    latest_path = directory / LATEST_NAME
    run_uid: str | None = None  # the run a fallback must belong to
    if latest_path.exists():
        try:
            target, run_uid = _read_latest(latest_path)
            tried.add(target)
            tensors, meta, _ = _load_pair(target)
            return tensors, meta
        except CheckpointError as err:
            problems.append(str(err))
            log.warning("%s; falling back to the newest complete checkpoint of the same run in %s", err, directory)
    if run_uid is None:
        runs = _runs_in(directory)
        if len(runs) > 1:  # no latest.json to say which run is meant: never guess between runs
            raise CheckpointError(
                f"checkpoint directory {directory}: holds checkpoints of {len(runs)} runs ("
                + "; ".join(f"run {uid}: {', '.join(names)}" for uid, names in runs.items())
                + ") and no readable latest.json; give the round file to resume from")
        run_uid = next(iter(runs), None)
    for _, json_path in reversed(list_checkpoints(directory)):
        if json_path in tried:
            continue
        try:
            tensors, meta, _ = _load_pair(json_path)
        except CheckpointError as err:
            problems.append(str(err))
            log.warning("skipping %s", err)
            continue
        if run_uid is not None and meta.get(RUN_KEY) != run_uid:
            problems.append(f"{json_path.name} belongs to another run ({RUN_KEY} {meta.get(RUN_KEY)!r}, "
                            f"not {run_uid!r})")
            log.warning("skipping %s: another run's checkpoint (%s %r, not %r)", json_path, RUN_KEY,
                        meta.get(RUN_KEY), run_uid)
            continue
        if problems:
            log.warning("loaded %s instead", json_path)
        return tensors, meta
    if not problems:
        raise CheckpointNotFoundError(f"checkpoint directory {directory}: contains no checkpoint")
    raise CheckpointError(f"checkpoint directory {directory}: no complete checkpoint"
                          + (f" of run {run_uid}" if run_uid else "") + "; " + "; ".join(problems))


def _runs_in(directory: Path) -> dict[str, list[str]]:
    """run uid -> the checkpoint JSONs of that run in `directory` (unreadable JSONs and those
    without a run uid, written before runs had one, are left out)."""
    runs: dict[str, list[str]] = {}
    for _, json_path in list_checkpoints(directory):
        try:
            record = _read_json(json_path)
        except CheckpointError:
            continue
        uid = record.get("meta", {}).get(RUN_KEY) if isinstance(record, dict) else None
        if isinstance(uid, str):
            runs.setdefault(uid, []).append(json_path.name)
    return runs


def describe_directory(directory: str | Path) -> dict[str, Any] | None:
    """What a checkpoint directory holds, from its JSON alone (tensors unread): None when it holds
    no checkpoint; else the newest checkpoint's `round`, `run_uid`, `variant`, `num_rounds`,
    `preset`, `saved` (its JSON's modification time, ISO 8601 UTC) and `files` (how many
    checkpoints). For the message that refuses a new run into another run's directory."""
    import datetime

    directory = Path(directory)
    found = list_checkpoints(directory) if directory.is_dir() else []
    if not found:
        return None
    round_idx, json_path = found[-1]
    with contextlib.suppress(CheckpointError):
        json_path, _ = _read_latest(directory / LATEST_NAME)
    try:
        record = _read_json(json_path)
        meta = record.get("meta", {}) if isinstance(record, dict) else {}
        round_idx = record.get("round", round_idx) if isinstance(record, dict) else round_idx
        saved = datetime.datetime.fromtimestamp(json_path.stat().st_mtime, datetime.timezone.utc)
    except (CheckpointError, OSError):
        meta, saved = {}, None
    config = meta.get("config", {}) if isinstance(meta.get("config"), dict) else {}
    return {"round": round_idx, "run_uid": meta.get(RUN_KEY), "variant": meta.get("variant"),
            "num_rounds": config.get("num_rounds"), "preset": config.get("model", {}).get("preset"),
            "saved": saved.strftime("%Y-%m-%d %H:%M:%SZ") if saved else None, "files": len(found)}


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable: {err}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path}: corrupt JSON ({err})") from err


def _read_latest(latest_path: Path) -> tuple[Path, str | None]:
    """(the checkpoint JSON latest.json names, the run uid it records, if any)."""
    doc = _read_json(latest_path)
    if not isinstance(doc, dict) or doc.get("format") != LATEST_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"checkpoint {latest_path}: format {got!r}, expected {LATEST_FORMAT!r}")
    name = doc.get("checkpoint")
    if not _is_plain_name(name):
        raise CheckpointError(f"checkpoint {latest_path}: 'checkpoint' is {name!r}, expected a file name")
    uid = doc.get(RUN_KEY)
    return latest_path.parent / name, uid if isinstance(uid, str) and uid else None


def _is_plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def _load_pair(json_path: Path) -> tuple[dict[str, Tensor], dict, dict]:
    """Verify a checkpoint JSON and its tensors; (tensors, meta, the JSON record)."""
    record = _read_json(json_path)
    if not isinstance(record, dict):
        raise CheckpointError(f"checkpoint {json_path}: expected a JSON object, got {type(record).__name__}")
    if record.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {json_path}: format {record.get('format')!r}, expected {FORMAT!r}")
    for key, kind in (("round", int), ("tensors_file", str), ("tensors_sha256", str), ("tensors_bytes", int),
                      ("meta", dict)):
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise CheckpointError(f"checkpoint {json_path}: field {key!r} is {record.get(key)!r}, "
                                  f"expected a {kind.__name__}")
    if not _is_plain_name(record["tensors_file"]):
        raise CheckpointError(f"checkpoint {json_path}: tensors_file {record['tensors_file']!r} is not a file name")

    tensors_path = json_path.parent / record["tensors_file"]
    if not tensors_path.is_file():
        raise CheckpointError(f"checkpoint {json_path}: its tensors file {tensors_path} is missing")
    sha, size = _sha256(tensors_path)
    if size != record["tensors_bytes"]:
        raise CheckpointError(f"checkpoint {tensors_path}: {size} bytes, its JSON {json_path.name} records "
                              f"{record['tensors_bytes']}; the file was cut off mid-write or modified")
    if sha != record["tensors_sha256"]:
        raise CheckpointError(f"checkpoint {tensors_path}: sha256 {sha} differs from {record['tensors_sha256']} "
                              f"recorded in {json_path.name}; the file was cut off mid-write or modified")
    try:
        tensors = load_file(str(tensors_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {tensors_path}: not a readable safetensors file ({err})") from err
    return tensors, record["meta"], record


# ----------------------------------------------------------------------------- compatibility


_MISSING = object()


def check_compatible(meta: Mapping[str, Any], expected: Mapping[str, Any], path: str | Path) -> None:
    """Refuse to resume a run from a checkpoint of a different one (model, method, schema...).

    Each key of `expected` is compared with the checkpoint's `meta`; a key is looked up literally,
    then as a dotted path into nested dicts (`"config.method"`). Expected values are compared in
    their JSON form (tuples as lists), as meta comes back from JSON. All mismatches are reported
    at once: CheckpointError naming the file, each key, its value in the checkpoint and the
    expected one.
    """
    problems = []
    for key, want in expected.items():
        got = _lookup(meta, key)
        want_json = json.loads(json.dumps(want))
        if got is _MISSING:
            problems.append(f"{key} is missing from the checkpoint, expected {want_json!r}")
        elif got != want_json:
            problems.append(f"{key} is {got!r} in the checkpoint, expected {want_json!r}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not belong to this run: " + "; ".join(problems))


def _lookup(meta: Mapping[str, Any], key: str) -> Any:
    if key in meta:
        return meta[key]
    node: Any = meta
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Tensor]:
    """The global RNG states as uint8 tensors, ready to go into a checkpoint's tensors.

    `rng/torch` (CPU generator), `rng/numpy` (numpy's legacy global RandomState, as JSON bytes),
    `rng/python` (`random`, as JSON bytes), and `rng/cuda` ([devices, state] uint8) when CUDA is
    available. JSON rather than pickle: a checkpoint must never execute code when read.
    """
    np_state = np.random.get_state(legacy=False)
    np_doc = {
        "bit_generator": np_state["bit_generator"],
        "state": {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in np_state["state"].items()},
        "has_gauss": int(np_state["has_gauss"]),
        "gauss": float(np_state["gauss"]),
    }
    version, internal, gauss_next = random.getstate()
    py_doc = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
    sd = {
        "rng/torch": torch.get_rng_state().clone(),
        "rng/numpy": _json_to_uint8(np_doc),
        "rng/python": _json_to_uint8(py_doc),
    }
    if torch.cuda.is_available():
        sd[CUDA_RNG_KEY] = torch.stack([s.cpu() for s in torch.cuda.get_rng_state_all()])
    return sd


def set_rng_state(sd: Mapping[str, Tensor]) -> None:
    """Restore what `rng_state()` saved; `sd` may be a whole checkpoint (other keys are ignored).

    All states are decoded before any is applied, so a bad one changes nothing. `rng/cuda` is
    applied when CUDA is available (to as many devices as both sides have), else ignored.
    """
    missing = [k for k in RNG_KEYS if k not in sd]
    if missing:
        raise CheckpointError(f"RNG state incomplete: missing {missing}")
    torch_state = sd["rng/torch"]
    if not isinstance(torch_state, Tensor) or torch_state.dtype != torch.uint8:
        raise CheckpointError("rng/torch: expected a uint8 tensor")
    np_doc = _uint8_to_json(sd["rng/numpy"], "rng/numpy")
    py_doc = _uint8_to_json(sd["rng/python"], "rng/python")
    try:
        np_state = {
            "bit_generator": np_doc["bit_generator"],
            "state": {k: (np.asarray(v, dtype=np.uint32) if k == "key" else v) for k, v in np_doc["state"].items()},
            "has_gauss": int(np_doc["has_gauss"]),
            "gauss": float(np_doc["gauss"]),
        }
        py_state = (int(py_doc["version"]), tuple(int(x) for x in py_doc["internal"]), py_doc["gauss_next"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"RNG state malformed: {err!r}") from err

    torch.set_rng_state(torch_state.cpu().contiguous())
    np.random.set_state(np_state)
    random.setstate(py_state)
    if CUDA_RNG_KEY in sd:
        if torch.cuda.is_available():
            states = sd[CUDA_RNG_KEY]
            n = min(len(states), torch.cuda.device_count())
            if n != len(states) or n != torch.cuda.device_count():
                log.warning("CUDA RNG state saved for %d devices, %d present: restoring %d",
                            len(states), torch.cuda.device_count(), n)
            for i in range(n):
                torch.cuda.set_rng_state(states[i].cpu().contiguous(), i)
        else:
            log.info("checkpoint has a CUDA RNG state but CUDA is not available: ignored")


def _json_to_uint8(doc: Any) -> Tensor:
    data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _uint8_to_json(t: Any, key: str) -> Any:
    if not isinstance(t, Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CheckpointError(f"{key}: expected a 1-D uint8 tensor")
    try:
        return json.loads(t.cpu().numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{key}: not a JSON-encoded RNG state ({err})") from err


__all__ = [
    "CheckpointError", "CheckpointNotFoundError", "FORMAT", "check_compatible", "checkpoint_stem",
    "list_checkpoints", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state",
]
