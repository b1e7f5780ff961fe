"""The test run ends with the skipped tests, grouped by why, with what to install."""

from pathlib import Path

pytest_plugins = ["pytester"]


def test_the_run_ends_with_its_skips_and_why(pytester):
    pytester.syspathinsert(Path(__file__).resolve().parent)
    pytester.makeconftest("from skipsummary import pytest_terminal_summary  # noqa: F401")
    pytester.makepyfile(test_some="""
        import pytest

        def test_runs():
            pass

        @pytest.mark.parametrize("n", range(6))
        def test_speech(n):
            pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")

        def test_imports():
            pytest.importorskip("no_such_module_for_streamer")

        def test_video():
            pytest.importorskip("av_missing_here")
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:timeout")
    result.assert_outcomes(passed=1, skipped=8)
    result.stdout.fnmatch_lines([
        "*8 skipped, and why*",
        "   6 skipped: espeak-ng is not installed (apt-get install espeak-ng)",
        "         test_some.py::test_speech[[]0[]]",
        "         ... and 2 more",
        "   1 skipped: could not import 'av_missing_here'*",
    ])


def test_a_run_without_skips_says_so(pytester):
    pytester.syspathinsert(Path(__file__).resolve().parent)
    pytester.makeconftest("from skipsummary import pytest_terminal_summary  # noqa: F401")
    pytester.makepyfile(test_fine="def test_fine():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:timeout")
    result.stdout.fnmatch_lines(["*no tests skipped*"])
