"""A real job: four gloo ranks as two simulated nodes gather their topology, build the mesh
from it, and the step on that mesh equals the unsharded step."""

import fsg.testing
from tests.topology import workers


def test_mesh_from_the_gathered_topology_matches_the_unsharded_step():
    with fsg.testing.MultiRank(4) as ranks:
        meshes = ranks.run(workers.check_mesh_from_gathered_topology)
    assert meshes == [[[0, 2], [1, 3]]] * 4
