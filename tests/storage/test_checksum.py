"""Item checksums: the native many-at-once digests equal the `xxhash` package's, whole items
and items streamed in pieces alike."""

from __future__ import annotations

import numpy as np
import xxhash

from asynctron.storage.format._checksum import BodySegments, Checksums


def test_whole_and_streamed_items_digest_as_xxhash_does() -> None:
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 70_000, 5 << 20, 3)]
    checksums = Checksums(len(items) + 1)  # the last item has no bytes: no segment at all

    def segments(entries: list[tuple[int, int, int, bool]]) -> BodySegments:
        return BodySegments(
            items=np.array([item for item, *_ in entries], dtype=np.int64),
            addresses=np.array([items[item].ctypes.data + start for item, start, _, _ in entries],
                               dtype=np.uint64),
            sizes=np.array([size for *_, size, _ in entries], dtype=np.uint64),
            whole=np.array([whole for *_, whole in entries], dtype=bool))

    # item 2 arrives in three pieces over two batches; the others whole
    checksums.update(segments([(0, 0, 1, True), (2, 0, 1 << 20, False), (1, 0, 70_000, True)]))
    checksums.update(segments([(2, 1 << 20, 3 << 20, False), (2, 4 << 20, 1 << 20, False),
                               (3, 0, 3, True)]))
    assert checksums.hexdigests() == [xxhash.xxh3_64_hexdigest(item) for item in items] + [
        xxhash.xxh3_64_hexdigest(b"")]
