//! The node layout of a group: which ranks share a host, as the node-aware all-reduce
//! ([`super::hierarchical`]) and the cross-host byte counter see it.

use std::ops::Range;

/// Ranks grouped by host, each host's ranks contiguous and the hosts in rank order (node `j`
/// holds ranks `starts[j]..starts[j + 1]`), as every launcher numbers them
/// (`RANK = node_rank · nproc_per_node + local_rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Nodes {
    starts: Vec<usize>,
}

impl Nodes {
    /// The layout of `hosts` (one host identity per rank), or `None` when a host's ranks are
    /// not contiguous (ranks interleaved across hosts: no chain of nodes keeps rank order).
    pub(crate) fn from_hosts<S: AsRef<str>>(hosts: &[S]) -> Option<Self> {
        let mut starts = vec![0];
        for r in 1..hosts.len() {
            if hosts[r].as_ref() != hosts[r - 1].as_ref() {
                if hosts[..r].iter().any(|h| h.as_ref() == hosts[r].as_ref()) {
                    return None;
                }
                starts.push(r);
            }
        }
        starts.push(hosts.len());
        Some(Nodes { starts })
    }

    /// Number of nodes.
    pub(crate) fn count(&self) -> usize {
        self.starts.len() - 1
    }

    /// The ranks of node `j`.
    pub(crate) fn ranks(&self, j: usize) -> Range<usize> {
        self.starts[j]..self.starts[j + 1]
    }

    /// The node of `rank`.
    pub(crate) fn node_of(&self, rank: usize) -> usize {
        self.starts.partition_point(|&s| s <= rank) - 1
    }

    /// Channels of the node-aware all-reduce: the fewest ranks any node has, so that every
    /// node has a rank of its own for each channel.
    pub(crate) fn channels(&self) -> usize {
        (0..self.count())
            .map(|j| self.ranks(j).len())
            .min()
            .unwrap_or(1)
    }

    /// The rank of node `j` that carries channel `c` across nodes.
    pub(crate) fn owner(&self, j: usize, c: usize) -> usize {
        self.starts[j] + c
    }

    /// Whether the node-aware all-reduce can do better than the flat one: several nodes, one
    /// of them with several ranks (with one rank per node the flat algorithm already sends
    /// `2·S·(k−1)/k` per node).
    pub(crate) fn worth_it(&self) -> bool {
        self.count() >= 2 && (0..self.count()).any(|j| self.ranks(j).len() >= 2)
    }

    /// Whether the node-aware reduce-scatter sends fewer bytes across than the flat one: the
    /// chain sends one buffer `S` of partial sums per node boundary and the last node each
    /// other node's shards, where the flat reduce-scatter sends every rank's pieces for the
    /// other nodes' ranks, `L·(N−L)/N · S` from a node of `L` ranks. From three ranks per
    /// node on at two nodes, two at three.
    pub(crate) fn reduce_scatter_chain_pays(&self) -> bool {
        if !self.worth_it() {
            return false;
        }
        let n = self.starts.last().copied().unwrap_or(1) as f64;
        let l = (0..self.count())
            .map(|j| self.ranks(j).len())
            .max()
            .unwrap_or(1) as f64;
        l * (n - l) / n > 1.0
    }

    /// Whether the node-aware *compressed* all-reduce sends fewer bytes across than the flat
    /// one. Its partial sums cross nodes in f32 (twice the 16-bit wire: a partial sum of
    /// 16-bit values is not one, and rounding it would change the result), so the busiest node
    /// sends about `2 + (k−2)/(k−1)` times the 16-bit buffer; the flat one about
    /// `L·(N−L)/N + (N−1)/N` times (its raw values to the other nodes' reducers, then its ring
    /// edge across), `L` the largest node's ranks. The chain pays from three ranks per
    /// node on.
    pub(crate) fn compressed_chain_pays(&self) -> bool {
        let k = self.count();
        if !self.worth_it() {
            return false;
        }
        let n = self.starts.last().copied().unwrap_or(1) as f64;
        let l = (0..k).map(|j| self.ranks(j).len()).max().unwrap_or(1) as f64;
        let kf = k as f64;
        let chain = 2.0 + (kf - 2.0) / (kf - 1.0);
        let flat = l * (n - l) / n + (n - 1.0) / n;
        chain < flat
    }
}

#[cfg(test)]
impl Nodes {
    /// `sizes[j]` ranks on node `j`.
    pub(crate) fn of_sizes(sizes: &[usize]) -> Nodes {
        let hosts: Vec<String> = sizes
            .iter()
            .enumerate()
            .flat_map(|(j, &l)| std::iter::repeat_n(format!("h{j}"), l))
            .collect();
        Nodes::from_hosts(&hosts).expect("contiguous hosts")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(sizes: &[usize]) -> Nodes {
        Nodes::of_sizes(sizes)
    }

    #[test]
    fn the_compressed_chain_is_taken_from_three_ranks_per_node() {
        for (sizes, pays) in [
            (&[1, 1][..], false),
            (&[2, 2], false),
            (&[3, 3], true),
            (&[4, 4], true),
            (&[8, 8], true),
            (&[2, 2, 2], false),
            (&[4, 4, 4], true),
            (&[1, 1, 1, 1], false),
            (&[3, 1], false),
        ] {
            assert_eq!(layout(sizes).compressed_chain_pays(), pays, "{sizes:?}");
        }
    }

    #[test]
    fn contiguous_hosts_make_nodes() {
        let n = Nodes::from_hosts(&["a", "a", "a", "b", "c", "c"]).unwrap();
        assert_eq!(n.count(), 3);
        assert_eq!([n.ranks(0), n.ranks(1), n.ranks(2)], [0..3, 3..4, 4..6]);
        assert_eq!(
            (0..6).map(|r| n.node_of(r)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 2, 2]
        );
        assert_eq!(n.channels(), 1);
        assert_eq!(n.owner(2, 0), 4);
        assert!(n.worth_it());
    }

    #[test]
    fn interleaved_hosts_have_no_node_layout() {
        assert_eq!(Nodes::from_hosts(&["a", "b", "a", "b"]), None);
    }

    #[test]
    fn one_rank_per_node_or_one_node_is_not_worth_it() {
        assert!(!Nodes::from_hosts(&["a", "b", "c"]).unwrap().worth_it());
        assert!(!Nodes::from_hosts(&["a", "a", "a"]).unwrap().worth_it());
        let even = Nodes::from_hosts(&["a", "a", "b", "b"]).unwrap();
        assert!(even.worth_it());
        assert_eq!(even.channels(), 2);
    }
}
