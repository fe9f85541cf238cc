"""soma.Ray leaves nothing in /dev/shm after close: the start records' folder goes with its last record (issue 32).

No Ray needed: the records are files (soma.ray.records), made here in a folder of the test's own.
"""

import os

from soma.ray import records


def test_the_start_records_folder_goes_with_its_last_record_and_comes_back_when_needed(tmp_path, monkeypatch):
    where = str(tmp_path / "soma_ray_test")
    monkeypatch.setattr(records, "folder", lambda: where)
    first, second = records.StartRecord.made("actor-1"), records.StartRecord.made("actor-2")
    assert sorted(os.listdir(where)) == ["actor-1", "actor-2"]
    records.remove_all(["actor-1"])  # (a driver forgetting one node's actors: another's record is still there)
    assert os.listdir(where) == ["actor-2"]
    records.remove_all(["actor-2"])  # the last one: nothing is left, the folder neither
    assert not os.path.exists(where)
    third = records.StartRecord.made("actor-3")  # an actor starting after that makes it again
    third.note(b"f" * 48, 2)
    assert records.take("actor-3") == ("f" * 48, 2) and os.listdir(where) == []
    for record in (first, second, third):
        os.close(record.fd)
