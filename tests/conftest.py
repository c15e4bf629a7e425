import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads the real embedded model (select with -m slow)")
    config.addinivalue_line("markers", "ci: a slow test that CI runs anyway (-m 'not slow or ci')")
