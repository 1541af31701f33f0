"""The checksum of a checkpoint's files (hpcsync.resilience.checksums), as unit tests: what a
marker vouches for, and that a summed DCP file is on disk whole when DCP syncs it."""
import os
import random

from hpcsync.resilience import checksums


def sealed(files):
    return checksums.seal({"step": 1, "seq": 0, "files": {n: len(d) for n, d in files.items()}},
                          {n: checksums.hex_sum(checksums.digest(d)) for n, d in files.items()})


def test_a_checksummed_marker_that_lost_its_version_is_not_read_by_sizes_only():
    """A marker carrying checksums whose ``version`` was lost (or damaged) cannot vouch for its
    files by sizes alone: it is damaged, and a same-size changed file is found either way."""
    rng = random.Random(7)
    for _ in range(50):
        data = rng.randbytes(rng.randrange(1, 400))
        marker = sealed({"a.pt": data})
        bad = bytearray(data)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        for damaged in ({k: v for k, v in marker.items() if k != "version"}, {**marker, "version": "2"},
                        {**marker, "version": 1}):
            assert checksums.marker_problem(damaged) is not None, damaged
            assert checksums.file_problem(damaged, "a.pt", bytes(bad)) is not None, damaged
        assert checksums.marker_problem(marker) is None and checksums.file_problem(marker, "a.pt", data) is None
    old = {"step": 1, "seq": 0, "files": {"a.pt": 3}}  # an older hpcsync's: sizes only
    assert checksums.marker_problem(old) is None and checksums.file_problem(old, "a.pt", b"xyz") is None


def test_a_summed_file_is_whole_on_disk_when_it_is_synced(tmp_path):
    """DCP syncs each file through ``os.fsync(stream.fileno())`` before it closes the stream:
    every byte written through the summing stream must be in the file by then."""
    fs = checksums.SummingFileSystem()
    rng = random.Random(3)
    for i in range(20):
        path = tmp_path / f"f{i}"
        chunks = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(rng.randrange(1, 6))]
        with fs.create_stream(path, "wb") as stream:
            for c in chunks:
                stream.write(c)
            os.fsync(stream.fileno())
            on_disk = os.path.getsize(path)
        assert on_disk == sum(map(len, chunks)), (i, on_disk)
        assert fs.sums[path.name] == checksums.hex_sum(checksums.digest(b"".join(chunks)))
