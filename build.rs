//! Rebuilds the crate when a migration changes: `sqlx::migrate!` embeds them at compile time,
//! and Cargo would not otherwise look at the `migrations` folder.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
