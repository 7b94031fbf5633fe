//! The nodes an `AMQP_URL` names (one URL, or a cluster's nodes separated by
//! commas), checked as one list, and the order a connection tries them in.

use lapin::uri::AMQPUri;

use super::{BrokerError, Result, redact_url};

/// The nodes an `AMQP_URL` names: one URL, or the URLs of a cluster's nodes
/// separated by commas. They share one login and one virtual host (a cluster's
/// users and vhosts are the cluster's, not a node's), so that a connection can
/// move from one node to another.
#[derive(Clone, Debug)]
pub(crate) struct Nodes {
    pub(super) uris: Vec<AMQPUri>,
}

impl Nodes {
    /// Parses a list, naming (with every password masked) what is wrong with it.
    pub(crate) fn parse(list: &str) -> Result<Nodes> {
        let texts: Vec<&str> = list.split(',').map(str::trim).collect();
        let count = texts.len();
        let mut uris: Vec<AMQPUri> = Vec::with_capacity(count);
        for (i, text) in texts.iter().enumerate() {
            let at = || {
                if count == 1 {
                    String::new()
                } else {
                    format!("node {} of {count}: ", i + 1)
                }
            };
            if text.is_empty() {
                return Err(BrokerError::BadUrl(format!(
                    "{}an empty URL (in {:?}); separate the nodes' URLs with single commas",
                    at(),
                    redact_url(list)
                )));
            }
            // The parser's own message may quote the text, password and all: it
            // is not passed on.
            let uri: AMQPUri = text.parse().map_err(|_: String| {
                BrokerError::BadUrl(format!(
                    "{}{} is not an AMQP URL like amqp://user:password@host:5672/%2f \
                     (nodes are separated by commas; a comma inside a password is written %2C)",
                    at(),
                    redact_url(text)
                ))
            })?;
            if let Some(first) = uris.first()
                && (first.authority.userinfo != uri.authority.userinfo || first.vhost != uri.vhost)
            {
                return Err(BrokerError::BadUrl(format!(
                    "{}{} names another user, password or virtual host than node 1 ({}); \
                     the nodes of one cluster share them, and a connection moves between nodes with one login",
                    at(),
                    redact_url(text),
                    redact_url(texts[0])
                )));
            }
            uris.push(uri);
        }
        Ok(Nodes { uris })
    }

    /// How many nodes the list names (at least one, once parsed).
    pub(super) fn len(&self) -> usize {
        self.uris.len()
    }
}

/// Which node a connection tries first: the first of the list at the start, and
/// after a loss the one after the node it lost, so that a dead node is tried
/// last.
pub(super) struct Rotation {
    pub(super) nodes: Nodes,
    next: std::sync::atomic::AtomicUsize,
}

impl Rotation {
    /// A rotation of `nodes` that tries node `first` first.
    pub(super) fn starting_at(nodes: Nodes, first: usize) -> Rotation {
        Rotation {
            nodes,
            next: std::sync::atomic::AtomicUsize::new(first),
        }
    }

    /// The nodes to try, in order: from the current one round the list.
    pub(super) fn order(&self) -> impl Iterator<Item = (usize, &AMQPUri)> {
        let count = self.nodes.len();
        let start = self.next.load(std::sync::atomic::Ordering::SeqCst);
        (0..count).map(move |i| {
            let k = (start + i) % count;
            (k, &self.nodes.uris[k])
        })
    }

    /// Node `k` took the connection: when it is lost, the next try starts at the
    /// node after it.
    pub(super) fn connected(&self, k: usize) {
        let next = (k + 1) % self.nodes.len();
        self.next.store(next, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A node's address for logs: scheme, host and port, no login.
pub(super) fn describe_uri(uri: &AMQPUri) -> String {
    format!(
        "{:?}://{}:{}",
        uri.scheme, uri.authority.host, uri.authority.port
    )
    .to_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_names_nodes_that_share_a_login_and_a_vhost() {
        let nodes = Nodes::parse(
            "amqp://guest:guest@127.0.0.1:5673/%2f,amqp://guest:guest@127.0.0.1:5674/%2f, amqp://guest:guest@127.0.0.1:5675/%2f",
        )
        .unwrap();
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes.uris[1].authority.port, 5674);
        assert_eq!(nodes.uris[2].vhost, "/");
        assert_eq!(Nodes::parse("amqp://127.0.0.1:5672/%2f").unwrap().len(), 1);

        let error = |list: &str| match Nodes::parse(list) {
            Err(BrokerError::BadUrl(e)) => e,
            other => panic!("{list}: {other:?}"),
        };
        let e = error("amqp://u:secret@h1/%2f,,amqp://u:secret@h2/%2f");
        assert!(e.contains("node 2 of 3") && e.contains("empty"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        let e = error("amqp://u:secret@h1/%2f,http://u:secret@h2/%2f");
        assert!(
            e.contains("node 2 of 2") && e.contains("not an AMQP URL"),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        // An unencoded comma in a password splits it: refused, nothing shown.
        let e = error("amqp://u:pa,ss@h1/%2f");
        assert!(e.contains("%2C") && !e.contains("ss@"), "{e}");
        let e = error("amqp:u:secret@h/%2f");
        assert!(!e.contains("secret"), "{e}");
        let e = error("amqp://u:secret@h1/%2f,amqp://u:other@h2/%2f");
        assert!(e.contains("another user, password or virtual host"), "{e}");
        assert!(!e.contains("secret") && !e.contains("other@"), "{e}");
        let e = error("amqp://u:p@h1/one,amqp://u:p@h2/two");
        assert!(e.contains("node 2 of 2"), "{e}");
        let e = error("");
        assert!(e.contains("empty") && !e.contains("node 1"), "{e}");
    }
}
