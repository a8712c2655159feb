"""Copy-on-write episode state over one shared base database, and its exact canonical hash.

Why: RL resets and scores thousands of episodes per step. A deep copy of the 7 MB database per reset and a full
canonical-JSON sha256 per reward would dominate. Here:

1. ``EpisodeState`` reads through to the shared base and copies a record into its own overlay only when a tool first
   writes it, so ``reset()`` copies nothing and concurrent episodes never interfere.
2. ``db_hash()`` is *by construction* the sha256 of ``canonical_json(full database)``, the same bytes a naive
   implementation would hash: the base's canonical serialisation is precomputed as one blob per table with hasher
   checkpoints before every record, so hashing a modified state resumes from the checkpoint before the first changed
   record and feeds unchanged runs as blob slices.
3. Records an episode touches live in its overlay as pydantic models (the domain's record models), because τ²'s tools
   mutate models in place, store some arguments unvalidated and fail half-way with the changes made so far; the tools
   here do the same to the overlay models. Reads that change nothing use the plain dicts.
4. Hashes are memoised by the state's change fingerprint (the canonical bytes of the records that differ from the
   base): equal fingerprints imply equal full databases, so an agent episode that reproduces the gold changes gets
   the cached gold hash at the cost of serialising a handful of records.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from tau2_rl.envs.spec import DomainSpec


JsonDict = dict[str, Any]
_MAX_MEMO = 8192
_SEP = b", "  # json.dumps' default item separator, between the records of a table


def dump(model: BaseModel) -> dict[str, Any]:
    """``model_dump`` without the serializer warnings: τ² stores some arguments unvalidated (that is the point)."""
    return model.model_dump(warnings=False)


def dumps_unbounded(obj: Any, **kwargs: Any) -> str:
    """``json.dumps``, also for integers past Python's 4300-digit printing limit (where τ² itself would crash)."""
    try:
        return json.dumps(obj, **kwargs)
    except ValueError:
        limit = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            return json.dumps(obj, **kwargs)
        finally:
            sys.set_int_max_str_digits(limit)


def canonical_json(obj: Any) -> bytes:
    """τ²'s serialisation for its database hash: ``json.dumps(obj, sort_keys=True, default=str)`` (``get_dict_hash``).

    Default separators (``", "``, ``": "``) and ASCII escapes; with the database stored as τ²'s ``model_dump``, the
    hash below is the very string τ²'s ``Environment.get_db_hash()`` returns for the same state.
    """
    return dumps_unbounded(obj, sort_keys=True, default=str).encode()


def naive_db_hash(db: dict[str, dict[str, Any]]) -> str:
    """Reference definition of the database hash: sha256 of the canonical JSON of the whole database."""
    return hashlib.sha256(canonical_json(db)).hexdigest()


def copy_json(obj: Any) -> Any:
    """Deep copy for JSON-shaped data (dict/list/scalars); ~5x faster than ``copy.deepcopy``."""
    if isinstance(obj, dict):
        return {k: copy_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_json(v) for v in obj]
    return obj


def _piece(key: str, record: Any) -> bytes:
    """One ``"key": record`` member of a table object, exactly as ``json.dumps(sort_keys=True)`` writes it."""
    return json.dumps(key).encode() + b": " + canonical_json(record)


class CanonicalBase:
    """The read-only base database plus its precomputed canonical serialisation and hasher checkpoints."""

    def __init__(self, db: dict[str, dict[str, Any]], spec: DomainSpec) -> None:
        """``spec``: the domain the database is of (its record models type the records a tool writes; its tools run
        on states over this base)."""
        self.spec = spec
        self.models: dict[str, type[BaseModel]] = dict(spec.models())
        if sorted(db) != sorted(self.models):
            raise ValueError(f"database must have exactly the tables {tuple(self.models)}, got {sorted(db)}")
        self.db = db
        self.table_order = sorted(db)  # json sort_keys order
        self.keys: dict[str, list[str]] = {}
        self.index: dict[str, dict[str, int]] = {}
        self.blob: dict[str, bytes] = {}
        self.starts: dict[str, list[int]] = {}
        self.ends: dict[str, list[int]] = {}
        # checkpoints[table][i]: hasher state after everything preceding record i of the table (including the comma
        # after record i-1); checkpoints[table][n]: after the table's last record, before the closing brace.
        self.checkpoints: dict[str, list[Any]] = {}
        hasher = hashlib.sha256()
        for position, table in enumerate(self.table_order):
            hasher.update(self._header(position))
            keys = sorted(db[table])
            pieces = [_piece(k, db[table][k]) for k in keys]
            starts, ends, offset = [], [], 0
            for piece in pieces:
                starts.append(offset)
                offset += len(piece)
                ends.append(offset)
                offset += len(_SEP)
            blob = _SEP.join(pieces)
            checkpoints = []
            for i in range(len(pieces)):
                if i == 0:
                    checkpoints.append(hasher.copy())
                hasher.update(pieces[i])
                if i + 1 < len(pieces):
                    hasher.update(_SEP)
                    checkpoints.append(hasher.copy())
            if not pieces:
                checkpoints.append(hasher.copy())
            checkpoints.append(hasher.copy())
            self.keys[table] = keys
            self.index[table] = {k: i for i, k in enumerate(keys)}
            self.blob[table] = blob
            self.starts[table] = starts
            self.ends[table] = ends
            self.checkpoints[table] = checkpoints
        hasher.update(b"}}")
        self.base_hash = hasher.hexdigest()
        self._memo: dict[bytes, str] = {b"": self.base_hash}

    def new_state(self) -> EpisodeState:
        """A fresh episode's state over this base (copies nothing)."""
        return EpisodeState(self)

    def gold_state(self, task: Any) -> EpisodeState:
        """A fresh state with the task's gold actions replayed (τ² logs and skips a failing gold action)."""
        state = EpisodeState(self)
        for action in task.actions:
            self.spec.execute_tool(state, action.name, action.arguments)
        return state

    def _header(self, position: int) -> bytes:
        name = json.dumps(self.table_order[position]).encode()
        return (b"{" if position == 0 else b"}, ") + name + b": {"

    def base_piece(self, table: str, key: str) -> bytes:
        i = self.index[table][key]
        return self.blob[table][self.starts[table][i] : self.ends[table][i]]

    def hash_with_changes(self, changes: dict[str, dict[str, bytes]], fingerprint: bytes) -> str:
        """Full-database sha256 with ``changes[table][key] = new canonical piece`` replacing or adding records."""
        cached = self._memo.get(fingerprint)
        if cached is not None:
            return cached
        digest = self._hash_with_changes(changes)
        if len(self._memo) >= _MAX_MEMO:
            self._memo.clear()
            self._memo[b""] = self.base_hash
        self._memo[fingerprint] = digest
        return digest

    def _hash_with_changes(self, changes: dict[str, dict[str, bytes]]) -> str:
        first_table = next(i for i, t in enumerate(self.table_order) if changes.get(t))
        hasher = None
        for position in range(first_table, len(self.table_order)):
            table = self.table_order[position]
            keys = self.keys[table]
            table_changes = changes.get(table, {})
            changed_keys = sorted(table_changes)
            if hasher is None:
                # Resume right before the first changed (or inserted) record of the first changed table.
                k = bisect.bisect_left(keys, changed_keys[0])
                hasher = self.checkpoints[table][k].copy()
                need_comma = k == len(keys) and k > 0
            else:
                hasher.update(self._header(position))
                k, need_comma = 0, False
            self._feed_table(hasher, table, k, changed_keys, table_changes, need_comma)
        hasher.update(b"}}")
        return hasher.hexdigest()

    def _feed_table(
        self,
        hasher: Any,
        table: str,
        start: int,
        changed_keys: list[str],
        table_changes: dict[str, bytes],
        need_comma: bool,
    ) -> None:
        keys, starts, ends, index = self.keys[table], self.starts[table], self.ends[table], self.index[table]
        blob = self.blob[table]
        i = start  # next base record to emit
        view = memoryview(blob)
        for key in changed_keys:
            j = index.get(key)
            stop = j if j is not None else bisect.bisect_left(keys, key, lo=i)
            if stop > i:  # an unchanged run of base records i..stop-1
                if need_comma:
                    hasher.update(_SEP)
                hasher.update(view[starts[i] : ends[stop - 1]])
                need_comma = True
            if need_comma:
                hasher.update(_SEP)
            hasher.update(table_changes[key])
            need_comma = True
            i = stop + 1 if j is not None else stop
        if i < len(keys):
            if need_comma:
                hasher.update(_SEP)
            hasher.update(view[starts[i] : ends[len(keys) - 1]])


class EpisodeState:
    """One episode's view of the database: reads fall through to the base, writes go to the episode's own models.

    ``get`` and ``values`` return plain dicts (τ²'s ``model_dump`` of the record) to treat as read-only; ``model``
    returns the episode's private, mutable pydantic record, validated from the base on first use.
    """

    __slots__ = ("base", "overlay")

    def __init__(self, base: CanonicalBase) -> None:
        self.base = base
        self.overlay: dict[str, dict[str, BaseModel]] = {table: {} for table in base.models}

    def get(self, table: str, key: str) -> JsonDict | None:
        record = self.overlay[table].get(key)
        if record is not None:
            return dump(record)
        return self.base.db[table].get(key)

    def contains(self, table: str, key: str) -> bool:
        """``key in table``, with Python's own ``TypeError`` for an unhashable key (τ²'s tools raise it too)."""
        return key in self.overlay[table] or key in self.base.db[table]

    def model(self, table: str, key: str) -> BaseModel:
        record = self.overlay[table].get(key)
        if record is None:
            record = self.base.models[table].model_validate(self.base.db[table][key])
            self.overlay[table][key] = record
        return record

    def insert(self, table: str, key: str, record: BaseModel) -> None:
        if self.contains(table, key):
            raise KeyError(f"{table} already has a record {key!r}")
        self.overlay[table][key] = record

    def values(self, table: str) -> Iterator[JsonDict]:
        """All records of a table in the base's order, overlay first where present, then inserted records."""
        overlay = self.overlay[table]
        for key, record in self.base.db[table].items():
            yield dump(overlay[key]) if key in overlay else record
        for key, record in overlay.items():
            if key not in self.base.db[table]:
                yield dump(record)

    def changes(self) -> dict[str, dict[str, bytes]]:
        """Canonical pieces of the records that differ from the base (a written-back identical record is dropped)."""
        result: dict[str, dict[str, bytes]] = {}
        for table in self.base.table_order:
            overlay = self.overlay[table]
            if not overlay:
                continue
            base_index = self.base.index[table]
            for key, record in overlay.items():
                piece = _piece(key, dump(record))
                if key in base_index and piece == self.base.base_piece(table, key):
                    continue
                result.setdefault(table, {})[key] = piece
        return result

    @staticmethod
    def _fingerprint(changes: dict[str, dict[str, bytes]]) -> bytes:
        if not changes:
            return b""
        hasher = hashlib.sha256()
        for table in sorted(changes):
            for key in sorted(changes[table]):
                piece = changes[table][key]
                hasher.update(f"{table}\0{len(piece)}\0".encode())
                hasher.update(piece)
        return hasher.digest()

    def fingerprint(self) -> bytes:
        """A digest of exactly what differs from the base; equal fingerprints mean equal databases."""
        return self._fingerprint(self.changes())

    def db_hash(self) -> str:
        """τ²'s database hash of this episode's database (equals ``naive_db_hash(self.materialize())``)."""
        changes = self.changes()
        return self.base.hash_with_changes(changes, self._fingerprint(changes))

    def materialize(self) -> dict[str, dict[str, Any]]:
        """The full database as a fresh dict (slow; for tests, debugging and the naive baseline)."""
        db = {}
        for table in self.base.models:
            merged = dict(self.base.db[table])
            merged.update({key: dump(record) for key, record in self.overlay[table].items()})
            db[table] = merged
        return db
