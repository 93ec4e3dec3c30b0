def pytest_terminal_summary(terminalreporter):
    from .targets import COUNTS
    if COUNTS:
        terminalreporter.write_line("fuzz executions per boundary: " + ", ".join(
            f"{k} {v}" for k, v in sorted(COUNTS.items())) + f" (total {sum(COUNTS.values())})")
