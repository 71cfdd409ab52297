import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "corpus: third-party programs run through jit against eager (tests/corpus)"
    )
