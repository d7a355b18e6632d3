"""``paratrain bench``: bad flags end in one line and exit 2, before anything runs."""

import pytest


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--suites", "allreduce,magic"],
            ["--suites must be one or more of allreduce, ps, codecs, pipeline", "'allreduce,magic'"],
        ),
        (["--suites", ","], ["--suites"]),
        (["--json-out", "/nonexistent/dir/b.json"], ["--json-out", "does not exist"]),
        (["--quick", "--repeats", "2"], ["unrecognized arguments: --repeats"]),
    ],
)
def test_bad_bench_flags_are_one_line_and_exit_2(cli, args, words):
    result = cli("bench", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


def test_bench_out_that_is_a_file_is_refused(cli, tmp_path):
    path = tmp_path / "taken"
    path.write_text("x")
    result = cli("bench", "--quick", "--out", str(path))
    assert result.returncode == 2
    assert "is a file; give a folder" in result.stderr
    assert path.read_text() == "x"
