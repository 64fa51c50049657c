"""Clustering primitives as small pure functions (NumPy or torch in and out; no state, no files,
nothing from the rest of flockfl but its random streams).

- :mod:`~flockfl.clustering.subspaces`: data bases U_p, principal angles and PACFL's proximity
  measures (Eqs. 3.1, 3.2, 5.1, 5.2, App. A).
- :mod:`~flockfl.clustering.hierarchy`: agglomerative clustering (App. A.3), PME's linkage
  distances, k-means and its centres, FLIS-DC's threshold clusters.
- :mod:`~flockfl.clustering.similarity`: FLIS's inference similarity, label proportions and EMD,
  ARI / NMI, embeddings of client updates (FlexCFL's EDC, IFCA's pre-training embedding).
- :mod:`~flockfl.clustering.groups`: FlexCFL's group maths (k-means++, MADC, Eq. 8, the W1 shift
  detectors, inter-group aggregation) and FeSEM's ℓ2 E-step.
- :mod:`~flockfl.clustering.lrcos`: FedAC's LrCos (PCA projection, cosine), E/M steps and Cluster
  Number Tuning.
- :mod:`~flockfl.clustering.gossip`: DIFCA's pairwise gossip, token draw and the reference code's
  exchange.
"""

from flockfl.clustering.groups import (
    cosine_matrix,
    eq8_assign,
    inter_group,
    kmeans_partition,
    label_counts,
    madc_matrix,
    nearest_centers,
    shift_detected,
    w1_labels,
    w1_sorted_counts,
)

from flockfl.clustering.hierarchy import (
    hierarchical_clusters,
    kmeans_centres,
    kmeans_labels,
    point_to_cluster_distances,
    threshold_clusters,
)
from flockfl.clustering.similarity import (
    ari,
    edc_embedding,
    inference_similarity,
    label_emd,
    label_proportions,
    mean_pairwise,
    nmi,
    one_hot_predictions,
    update_embedding,
)
from flockfl.clustering.subspaces import (
    client_signature,
    cross_proximity,
    data_basis,
    principal_angles,
    proximity_matrix,
    subspace_distance,
)

__all__ = [
    "ari",
    "client_signature",
    "cosine_matrix",
    "cross_proximity",
    "data_basis",
    "edc_embedding",
    "eq8_assign",
    "hierarchical_clusters",
    "inference_similarity",
    "inter_group",
    "kmeans_centres",
    "kmeans_labels",
    "kmeans_partition",
    "label_counts",
    "label_emd",
    "label_proportions",
    "madc_matrix",
    "mean_pairwise",
    "nearest_centers",
    "nmi",
    "one_hot_predictions",
    "point_to_cluster_distances",
    "principal_angles",
    "proximity_matrix",
    "shift_detected",
    "subspace_distance",
    "threshold_clusters",
    "update_embedding",
    "w1_labels",
    "w1_sorted_counts",
]
