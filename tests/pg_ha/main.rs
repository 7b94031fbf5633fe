//! PostgreSQL failing over under onejob: `scripts/pg-ha`, a highly available
//! PostgreSQL of the test's own (Patroni, etcd and HAProxy), first held to
//! its own promise (`cluster`), then with a fleet through each way its
//! primary fails (`fleet`); the gauges that say whether commits wait for a
//! standby as the cluster changes (`replication`); and the failover
//! benchmark run small (`figures`). Run one at a time with the chaos tests (scripts/test): a
//! failover waits on etcd's 10 s leader key.

mod cluster;
mod figures;
mod fleet;
mod replication;
