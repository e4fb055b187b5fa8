//! Rebuilds the crate when a migration changes: `sqlx::migrate!` embeds them at compile time,
//! and Cargo would not otherwise look at the `migrations` folder. Names the commit the binary is
//! built from (`idem --version`, `idem_build_info`), when it is built from a git checkout.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed=IDEM_COMMIT");
    let commit = std::env::var("IDEM_COMMIT").ok().or_else(git_commit).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IDEM_COMMIT={commit}");
}

/// The checkout's commit, abbreviated; `None` outside a git checkout (a crate package, a
/// container build without `.git`). Changes not committed yet are not told apart: the script
/// runs again only when the checkout moves to another commit.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| Command::new("git").args(args).output().ok().filter(|o| o.status.success());
    let head = git(&["rev-parse", "--short=12", "HEAD"])?;
    let head = String::from_utf8(head.stdout).ok()?.trim().to_string();
    // Rebuilt when the checkout moves to another commit.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).and_then(|o| String::from_utf8(o.stdout).ok()) {
        let dir = dir.trim();
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/refs/heads");
    }
    Some(head)
}
