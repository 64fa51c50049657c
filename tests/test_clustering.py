"""flockfl.clustering against values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from flockfl import clustering as cl
from flockfl.clustering.subspaces import stacked_proximity

C30, S30 = np.cos(np.radians(30)), np.sin(np.radians(30))
E = np.eye(4)


def col(*vs):
    return np.stack(vs, axis=1)


# ---------------------------------------------------------------------- bases


def test_data_basis_is_the_top_left_singular_vectors_of_the_raw_samples():
    # samples as columns: D = [[2,0,2],[0,1,0],[0,0,0]], DDᵀ = diag(8, 1, 0) → u1 = ±e1, u2 = ±e2
    x = np.array([[2.0, 0, 0], [0, 1, 0], [2, 0, 0]])
    u = cl.data_basis(x, 2)
    assert u.shape == (3, 2) and u.dtype == np.float64
    np.testing.assert_allclose(np.abs(u), [[1, 0], [0, 1], [0, 0]], atol=1e-12)
    # any trailing shape is flattened; p is capped at min(samples, features)
    assert cl.data_basis(np.ones((2, 1, 2, 2)), 9).shape == (4, 2)
    with pytest.raises(ValueError, match="no samples"):
        cl.data_basis(np.zeros((0, 3)), 2)


@pytest.mark.parametrize("shape", [(50, 20), (12, 40)])
def test_gram_route_gives_the_svd_basis_up_to_sign(shape):
    x = np.random.default_rng(0).random(shape)
    a, b = cl.data_basis(x, 3), cl.data_basis(x, 3, method="gram")
    np.testing.assert_allclose(np.abs((a * b).sum(0)), 1.0, atol=1e-10)  # column by column, same direction


def test_client_signature_whole_and_per_class():
    rng = np.random.default_rng(1)
    x, y = rng.random((9, 6)), np.array([2, 0, 0, 2, 0, 5, 5, 0, 2])
    per = cl.client_signature(x, y, 2)  # labels 0 (4 samples), 2 (3), 5 (2): 2 columns each
    assert per.shape == (6, 6)
    np.testing.assert_allclose(per[:, 2:4], cl.data_basis(x[y == 2], 2))
    np.testing.assert_allclose(cl.client_signature(x, y, 3, "whole"), cl.data_basis(x, 3))


# ---------------------------------------------------------------------- angles


def test_identical_and_orthogonal_subspaces():
    u = np.linalg.qr(np.random.default_rng(2).standard_normal((6, 3)))[0]
    for m in ("smallest_angle", "trace", "sum_angles", "official_min_pairwise"):
        assert cl.subspace_distance(u, u, m) == pytest.approx(0.0, abs=1e-5)
    a, b = col(E[0], E[1]), col(E[2], E[3])
    assert cl.subspace_distance(a, b, "smallest_angle") == pytest.approx(90.0)
    assert cl.subspace_distance(a, b, "sum_angles") == pytest.approx(180.0)
    assert cl.subspace_distance(a, b, "trace") == pytest.approx(180.0)
    assert cl.subspace_distance(a, b, "official_min_pairwise") == pytest.approx(90.0)


def test_a_known_30_degree_angle():
    u, w = col(E[0]), col(C30 * E[0] + S30 * E[1])
    np.testing.assert_allclose(cl.principal_angles(u, w), [np.radians(30)])
    for m in ("smallest_angle", "trace", "sum_angles", "official_min_pairwise"):
        assert cl.subspace_distance(u, w, m) == pytest.approx(30.0)


def test_principal_angles_ascending_and_equal_to_the_svd_formula():
    rng = np.random.default_rng(3)
    u = np.linalg.qr(rng.standard_normal((7, 2)))[0]
    w = np.linalg.qr(rng.standard_normal((7, 3)))[0]
    theta = cl.principal_angles(u, w)
    assert theta.shape == (2,) and theta[0] <= theta[1]  # min(p, q) angles, Θ_1 first
    np.testing.assert_allclose(theta, np.arccos(np.clip(np.linalg.svd(u.T @ w, compute_uv=False), -1, 1)), atol=1e-10)


def test_trace_matches_columns_in_order_unlike_principal_angles():
    # U = [e1, e2], W = [e1, cos60 e2 + sin60 e3]: principal angles 0° and 60°; matched columns 0° + 60°
    u, w = col(E[0], E[1]), col(E[0], 0.5 * E[1] + np.sqrt(0.75) * E[2])
    assert cl.subspace_distance(u, w, "trace") == pytest.approx(60.0)
    assert cl.subspace_distance(u, w, "sum_angles") == pytest.approx(60.0)
    assert cl.subspace_distance(u, w, "smallest_angle") == pytest.approx(0.0, abs=1e-6)
    # the same subspace with its columns swapped: principal angles 0, matched columns 90° + 90°
    v = col(E[1], E[0])
    assert cl.subspace_distance(u, v, "sum_angles") == pytest.approx(0.0, abs=1e-6)
    assert cl.subspace_distance(u, v, "trace") == pytest.approx(180.0)


def test_a_sign_flip_changes_only_the_official_measure():
    u, w = col(E[0]), col(C30 * E[0] + S30 * E[1])
    for m in ("smallest_angle", "trace", "sum_angles"):
        assert cl.subspace_distance(u, -w, m) == pytest.approx(30.0)
    assert cl.subspace_distance(u, -w, "official_min_pairwise") == pytest.approx(150.0)  # arccos(−cos30°)
    with pytest.raises(ValueError, match="unknown measure"):
        cl.subspace_distance(u, w, "cosine")


def test_proximity_and_cross_proximity():
    bases = [col(E[0]), col(C30 * E[0] + S30 * E[1]), col(E[1])]
    a = cl.proximity_matrix(bases, "smallest_angle")
    np.testing.assert_allclose(a, [[0, 30, 90], [30, 0, 60], [90, 60, 0]], atol=1e-9)
    c = cl.cross_proximity(bases[:1], bases, "smallest_angle")
    assert c.shape == (1, 3)
    np.testing.assert_allclose(c, [[0, 30, 90]], atol=1e-6)


def test_stacked_proximity_agrees_with_the_pairwise_loop():
    bases = [col(E[0], E[2]), col(C30 * E[0] + S30 * E[1], E[3]), col(E[1], E[2])]
    # pair (0, 1): principal angles 30°, 90°; matched columns 30° + 90°
    np.testing.assert_allclose(stacked_proximity(bases, "smallest_angle")[0], [0, 30, 0], atol=1e-6)
    np.testing.assert_allclose(stacked_proximity(bases, "trace")[0], [0, 120, 90], atol=1e-6)
    rng = np.random.default_rng(4)
    many = [np.linalg.qr(rng.standard_normal((12, 3)))[0] for _ in range(6)]
    for m in ("smallest_angle", "sum_angles", "trace"):
        np.testing.assert_allclose(stacked_proximity(many, m), cl.proximity_matrix(many, m), atol=1e-8)


# ---------------------------------------------------------------------- hierarchical clustering

# {0,1} at 1 and {2,3} at 2, 10 between the pairs
FOUR = np.array([[0, 1, 10, 10], [1, 0, 10, 10], [10, 10, 0, 2], [10, 10, 2, 0]], float)


def test_threshold_cut_and_its_extremes():
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR, threshold=5), [0, 0, 1, 1])
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR, threshold=1.5), [0, 0, 1, 2])
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR, threshold=0.5), [0, 1, 2, 3])  # SOLO
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR, threshold=100), [0, 0, 0, 0])  # FedAvg
    assert cl.hierarchical_clusters(FOUR, threshold=5).dtype == np.int64


def test_n_clusters_and_first_appearance_numbering():
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR, n_clusters=2), [0, 0, 1, 1])
    perm = [2, 0, 3, 1]  # client 0 is now a member of the {2,3} pair
    np.testing.assert_array_equal(cl.hierarchical_clusters(FOUR[np.ix_(perm, perm)], n_clusters=2), [0, 1, 0, 1])
    np.testing.assert_array_equal(cl.hierarchical_clusters(np.zeros((1, 1)), threshold=1), [0])
    with pytest.raises(ValueError, match="exactly one"):
        cl.hierarchical_clusters(FOUR)
    with pytest.raises(ValueError, match="exactly one"):
        cl.hierarchical_clusters(FOUR, threshold=1, n_clusters=2)
    with pytest.raises(ValueError, match="linkage"):
        cl.hierarchical_clusters(FOUR, threshold=1, linkage="ward")


def test_linkages_differ_as_computed_by_hand():
    # merges: {0,1} at 1, then {0,1}+2 at 2; point 3 is 10 from 0 and 1 and 7 from 2, so {0,1,2}–3 is
    # single 7, complete 10, UPGMA (10+10+7)/3 = 9, WPGMA ((10+10)/2 + 7)/2 = 8.5
    d = np.array([[0, 1, 2, 10], [1, 0, 2, 10], [2, 2, 0, 7], [10, 10, 7, 0]], float)
    for link, one_cluster_at in (("single", 7), ("weighted", 8.5), ("average", 9), ("complete", 10)):
        np.testing.assert_array_equal(cl.hierarchical_clusters(d, threshold=one_cluster_at - 0.01, linkage=link), [0, 0, 0, 1])
        np.testing.assert_array_equal(cl.hierarchical_clusters(d, threshold=one_cluster_at + 0.01, linkage=link), [0, 0, 0, 0])


def test_point_to_cluster_distances_by_hand():
    d, labels = np.array([1.0, 3, 5, 7, 2]), np.array([0, 0, 1, 1, 2])
    np.testing.assert_allclose(cl.point_to_cluster_distances(d, labels, "single"), [1, 5, 2])
    np.testing.assert_allclose(cl.point_to_cluster_distances(d, labels, "complete"), [3, 7, 2])
    np.testing.assert_allclose(cl.point_to_cluster_distances(d, labels, "average"), [2, 6, 2])
    np.testing.assert_allclose(cl.point_to_cluster_distances(d, labels, "weighted"), [2, 6, 2])


def test_kmeans_labels_two_blobs():
    x = np.array([[10.0, 10], [10.1, 10], [0, 0], [0.1, 0], [10, 10.1], [0, 0.1]])
    np.testing.assert_array_equal(cl.kmeans_labels(x, 2, seed=0), [0, 0, 1, 1, 0, 1])


def test_fedsc_recovers_three_disjoint_label_groups():
    """FedSC sanity test (spec core §3.2): label-proportion vectors of 3 disjoint label groups,
    complete linkage cut at 3 clusters."""
    hist = np.zeros((9, 6))
    for i, (a, b) in enumerate([(5, 5), (7, 3), (3, 7)] * 3):
        g = [0, 1, 2, 0, 1, 2, 0, 1, 2][i]  # interleaved groups: labels {0,1}, {2,3}, {4,5}
        hist[i, 2 * g], hist[i, 2 * g + 1] = a * (i + 1), b * (i + 1)
    props = cl.label_proportions(hist)
    dist = np.sqrt(((props[:, None] - props[None]) ** 2).sum(-1))
    labels = cl.hierarchical_clusters(dist, n_clusters=3, linkage="complete")
    np.testing.assert_array_equal(labels, [0, 1, 2] * 3)
    assert cl.ari(labels, [5, 6, 7] * 3) == 1.0


# ---------------------------------------------------------------------- FLIS similarity


def test_one_hot_and_inference_similarity():
    logits = np.array([[[2.0, 1, 0], [0, 3, 1], [0, 0, 1], [5, 1, 1]], [[9.0, 1, 0], [0, 3, 1], [0, 4, 1], [0, 2, 1]]])
    b = cl.one_hot_predictions(logits)  # predictions [0,1,2,0] and [0,1,1,1]: they agree on 2 of 4
    np.testing.assert_array_equal(b[0], [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])
    a = cl.inference_similarity(b, "cosine_sum")
    np.testing.assert_allclose(a, [[1, 0.5], [0.5, 1]])  # diagonal 1, off-diagonal the agreement fraction
    f = cl.inference_similarity(b, "frobenius_hadamard")  # ‖B_i⊙B_j‖_F/(‖B_i‖‖B_j‖) = √2/4, diag √4/4
    np.testing.assert_allclose(f, [[0.5, np.sqrt(2) / 4], [np.sqrt(2) / 4, 0.5]])
    with pytest.raises(ValueError, match="unknown form"):
        cl.inference_similarity(b, "dot")


def test_threshold_clusters_by_hand():
    sim = np.array([[1, 0.6, 0.2], [0.6, 1, 0.4], [0.2, 0.4, 1]])
    assert [c.tolist() for c in cl.threshold_clusters(sim, 0.5)] == [[0, 1], [0, 1], [2]]
    assert [c.tolist() for c in cl.threshold_clusters(sim, 0.3)] == [[0, 1], [0, 1, 2], [1, 2]]
    assert [c.tolist() for c in cl.threshold_clusters(sim, 0.0)] == [[0, 1, 2]] * 3  # β = 0: FedAvg
    assert [c.tolist() for c in cl.threshold_clusters(sim * 0, 1.5)] == [[0], [1], [2]]  # every i keeps itself


# ---------------------------------------------------------------------- label distributions, scores


def test_label_proportions_emd_and_mean_pairwise():
    props = cl.label_proportions(np.array([[2, 2, 0], [0, 0, 0], [1, 0, 3]]))
    np.testing.assert_allclose(props, [[0.5, 0.5, 0], [0, 0, 0], [0.25, 0, 0.75]])
    assert cl.label_emd(props[0], props[2]) == pytest.approx(0.75)  # (0.25 + 0.5 + 0.75) / 2
    assert cl.label_emd([1, 0], [0, 1]) == 1.0 and cl.label_emd([0.3, 0.7], [0.3, 0.7]) == 0.0
    assert cl.mean_pairwise(np.array([[0, 1, 2], [1, 0, 3], [2, 3, 0]])) == pytest.approx(2.0)
    assert cl.mean_pairwise(np.zeros((1, 1))) == 0.0


def test_ari_and_nmi():
    assert cl.ari([0, 0, 1, 1], [1, 1, 0, 0]) == 1.0 and cl.nmi([0, 0, 1, 1], [1, 1, 0, 0]) == pytest.approx(1.0)
    assert cl.ari([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(-0.5)  # (0 − 2/3) / (2 − 2/3)
    assert cl.nmi([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-12)


def test_ari_and_nmi_equal_scikit_learns_bit_for_bit():
    """flockfl computes ARI and NMI in NumPy (no scikit-learn import on a run's path); they are
    scikit-learn's numbers exactly, degenerate labelings (one cluster, all distinct, negatives) included."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    from flockfl.clustering.similarity import ari, nmi

    rng = np.random.default_rng(0)
    cases = [(np.zeros(5, int), np.zeros(5, int)), (np.arange(6), np.zeros(6, int)), (np.arange(7), np.arange(7)[::-1]),
             (np.array([3]), np.array([-1]))]
    for t in range(400):
        n = int(rng.integers(2, 50))
        a = rng.integers(0, int(rng.integers(1, 6)), n)
        b = a.copy() if t % 5 == 0 else rng.integers(-2, int(rng.integers(0, 5)) + 1, n) * 3
        cases.append((a, b))
    for a, b in cases:
        assert ari(a, b) == float(adjusted_rand_score(a, b)), (a, b)
        assert nmi(a, b) == float(normalized_mutual_info_score(a, b)), (a, b)
