//! The integration tests, in one binary: a real broker on port 0 in front of a real fake upstream,
//! driven over HTTP (and raw sockets, real SDKs, a real browser, real processes); the stores'
//! contract on SQLite and PostgreSQL; property tests of every parser. Each module names what it
//! proves; `common` is their shared harness, `mutate` the text mutations the parsers' property
//! tests apply.

mod common;
mod mutate;

mod admin;
mod agents;
mod canary;
mod canonical_json;
mod config_parser;
mod conformance;
mod console;
mod conventions;
mod crash;
mod data_plane;
mod deadlines;
mod demo;
mod deploy;
mod edge;
mod engine;
mod errors;
mod failover;
mod logs;
mod mcp;
mod metrics;
mod multinode;
mod never_twice;
mod parsers;
mod paths;
mod probe;
mod quotas;
mod reload;
mod sdk;
mod simulate;
mod simulate_history;
mod stats;
mod store;
mod store_down;
mod store_lost;
mod streaming;
mod switches;
mod tls;
mod traces;
