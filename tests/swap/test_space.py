"""Swap space: preallocated files, aligned extents, striping, and start-up checks."""
from __future__ import annotations

import os

import pytest

from csrc import ConfigError, SwapIOError, TierFullError
from swap import SwapSpace, SwapSpaceConfig


def test_files_are_preallocated_one_per_path_and_removed_at_close(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    space = SwapSpace(SwapSpaceConfig(paths=[str(d) for d in dirs], capacity_bytes=8 << 20))
    paths = [f.path for f in space.files]
    assert [os.path.dirname(p) for p in paths] == [str(d) for d in dirs]
    for f in space.files:
        st = os.fstat(f.fd)
        assert st.st_size == 4 << 20
        assert st.st_blocks * 512 >= 4 << 20, "fallocate must reserve the blocks"
    space.close()
    assert not any(os.path.exists(p) for p in paths)


def test_single_path_gives_one_aligned_extent_per_region(tmp_path):
    with SwapSpace(SwapSpaceConfig(paths=[str(tmp_path)], capacity_bytes=4 << 20)) as space:
        a = space.allocate(1)
        b = space.allocate(4097)
        assert a == [(0, 0, 0, 4096)]
        assert b == [(0, 4096, 0, 8192)]
        space.release(a)
        assert space.allocate(4096) == [(0, 0, 0, 4096)]
        assert space.used_bytes == 4096 + 8192


def test_striping_round_robins_stripes_over_files(tmp_path):
    dirs = [tmp_path / str(i) for i in range(3)]
    for d in dirs:
        d.mkdir()
    cfg = SwapSpaceConfig(paths=[str(d) for d in dirs], capacity_bytes=24 << 20, stripe_bytes=1 << 20)
    with SwapSpace(cfg) as space:
        n = (4 << 20) + 5  # 5 stripes, the last one 4096 bytes once padded
        ps = space.allocate(n)
        assert [p.file_index for p in ps] == [0, 1, 2, 0, 1]
        assert [p.region_offset for p in ps] == [i << 20 for i in range(5)]
        assert [p.nbytes for p in ps] == [1 << 20] * 4 + [4096]
        assert ps[3].file_offset == ps[0].file_offset + (1 << 20)
        assert space.used_bytes == (4 << 20) + 4096
        space.release(ps)
        assert space.used_bytes == 0


def test_striped_allocation_failing_in_a_later_file_gives_back_the_earlier_files_extents(tmp_path):
    """File 0 has room for its share of the stripes, file 1 has as many bytes free but too
    fragmented: the allocation fails naming file 1, and the extent it took in file 0 is
    returned, so the same room serves the next allocation (no leak)."""
    page = 4096
    dirs = [tmp_path / "0", tmp_path / "1"]
    for d in dirs:
        d.mkdir()
    cfg = SwapSpaceConfig(paths=[str(d) for d in dirs], capacity_bytes=16 * page, stripe_bytes=page)
    with SwapSpace(cfg) as space:  # two files of 8 pages, striped page by page
        singles = [space.allocate(page) for _ in range(4)]  # one stripe: file 0 only, pages 0-3
        pairs = [space.allocate(2 * page) for _ in range(4)]  # file 0 pages 4-7, file 1 pages 0-3
        assert {p.file_index for s in singles for p in s} == {0}
        assert [[p.file_index for p in ps] for ps in pairs] == [[0, 1]] * 4
        for ps in (pairs[0], pairs[2], *singles):
            space.release(ps)
        # free now: file 0 pages 0-4 and 6; file 1 pages 0, 2 and 4-7 (largest run: 4 pages)
        used = space.used_bytes
        assert used == 4 * page
        with pytest.raises(TierFullError, match=rf"needs {5 * page} bytes in swap file {space.files[1].path}.*"
                                                rf"largest run {4 * page}"):
            space.allocate(10 * page, "region 'r'")  # 5 pages in each file
        assert space.used_bytes == used, "the 5 pages taken in file 0 must be given back"
        # 9 stripes: 5 pages in file 0 (only pages 0-4 are free in a row), 4 in file 1
        ps = space.allocate(9 * page)
        assert sorted({(p.file_index, p.file_offset) for p in ps if p.file_index == 0}) == [
            (0, i * page) for i in range(5)]
        assert space.used_bytes == used + 9 * page


def test_full_space_is_a_tier_full_error_that_names_the_file(tmp_path):
    with SwapSpace(SwapSpaceConfig(paths=[str(tmp_path)], capacity_bytes=1 << 20)) as space:
        space.allocate(1 << 20)
        with pytest.raises(TierFullError, match=r"region 'r'.*ofl-swap"):
            space.allocate(1, "region 'r'")


def test_missing_path_fails_at_start(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SwapIOError, match=str(missing)):
        SwapSpace(SwapSpaceConfig(paths=[str(missing)], capacity_bytes=1 << 20))


def test_read_only_path_fails_at_start(readonly_dir, tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    with pytest.raises(SwapIOError, match=f"{readonly_dir} is not writable"):
        SwapSpace(SwapSpaceConfig(paths=[str(ok), str(readonly_dir)], capacity_bytes=2 << 20))
    assert os.listdir(ok) == [], "the file made before the failure is removed"


def test_a_file_system_too_small_fails_at_start(tiny_fs):
    with pytest.raises(TierFullError, match=f"swap path {tiny_fs}"):
        SwapSpace(SwapSpaceConfig(paths=[str(tiny_fs)], capacity_bytes=64 << 20))
    assert os.listdir(tiny_fs) == []


@pytest.mark.parametrize("kwargs,field", [
    (dict(paths=[], capacity_bytes=1), "paths"),
    (dict(paths=["/a", "/a"], capacity_bytes=1), "paths"),
    (dict(paths=["/a"], capacity_bytes=0), "capacity_bytes"),
    (dict(paths=["/a"], capacity_bytes=1, stripe_bytes=100), "stripe_bytes"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SwapSpaceConfig(**kwargs)
