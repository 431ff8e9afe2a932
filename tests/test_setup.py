"""scripts/setup_env.sh, the set-up both README commands start with: what it refuses before installing."""
from conftest import REPO, run


def test_too_little_disk_stops_before_the_venv_with_one_line(tmp_path):
    """A disk too full for PyTorch: one line naming the free space, the need and the fix; no venv left."""
    venv = tmp_path / "parent" / "venv"
    result = run(["bash", REPO / "scripts" / "setup_env.sh"],
                 env={"VENV": str(venv), "COURSE_MIN_FREE_GB": "1000000"}, check=False, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert f"GB free on the disk of {tmp_path}," in lines[0] and "needs about 1000000 GB" in lines[0]
    assert "VENV=" in lines[0]
    assert not (tmp_path / "parent").exists()
