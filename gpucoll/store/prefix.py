"""``PrefixStore``: a namespace inside a store, so subgroups and repeated runs never collide."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PrefixStore:
    """Every key becomes ``prefix + "/" + key`` in ``store`` (a TCPStore or another PrefixStore).

    It borrows the store: ``close()`` leaves the underlying connection to whoever opened it.
    """

    def __init__(self, prefix: str, store: Any):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"PrefixStore: prefix must be a non-empty str, got {prefix!r}")
        self.prefix = prefix
        self.store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.store!r})"

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def timeout(self) -> float:
        return self.store.timeout

    def _k(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
        return f"{self.prefix}/{key}"

    def _ks(self, keys: Sequence[str], what: str) -> list[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{what}: keys must be a list of str, not a single "
                            f"{type(keys).__name__}")
        return [self._k(k) for k in keys]

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout=timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self.store.compare_set(self._k(key), expected, desired)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self.store.wait(self._ks(keys, "wait"), timeout=timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(self._ks(keys, "check"))

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._k(key))

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Delete every key of this namespace that starts with ``prefix`` ("": all of them)."""
        if not isinstance(prefix, str):
            raise TypeError(f"delete_prefix: prefix must be a str, got {type(prefix).__name__}")
        return self.store.delete_prefix(f"{self.prefix}/{prefix}", timeout=timeout)

    def set_will(self, key: str, value: bytes | str, *, timeout: float | None = None) -> None:
        self.store.set_will(self._k(key), value, timeout=timeout)

    def clear_will(self, key: str, *, timeout: float | None = None) -> bool:
        return self.store.clear_will(self._k(key), timeout=timeout)

    def peek(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes | None]:
        return self.store.peek(self._ks(keys, "peek"), timeout=timeout)

    def num_keys(self) -> int:
        """Keys in the whole underlying store (as torch's PrefixStore reports)."""
        return self.store.num_keys()

    def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        return self.store.multi_get(self._ks(keys, "multi_get"), timeout=timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self.store.multi_set(self._ks(keys, "multi_set"), values)

    def close(self) -> None:
        """Nothing to release: the underlying store stays open for its owner."""
