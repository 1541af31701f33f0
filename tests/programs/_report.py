"""Shared by the test programs: write this rank's results as JSON for the test to read."""
import json
import os


def report(rank: int, data: dict) -> None:
    path = os.path.join(os.environ["HPCSYNC_TEST_OUT"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, default=str)
    os.replace(path + ".tmp", path)
