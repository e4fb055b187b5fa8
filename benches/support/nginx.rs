//! nginx, the reverse proxy operators deploy: the plain path the benchmarks judge Idem against.

// Each benchmark uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// nginx from the PATH, proxying to one upstream, with keep-alive connections to it and no
/// access log. Stopped when dropped.
pub struct Nginx {
    child: std::process::Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM, not SIGKILL: the master stops its workers before it exits.
        let _ = std::process::Command::new("kill").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
    }
}

/// How nginx passes an answer on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Buffering {
    /// nginx's default: it reads the upstream's answer into its buffers as it passes it on.
    Default,
    /// `proxy_buffering off`, as deployments in front of streamed answers (server-sent events)
    /// set it: each part is passed on as it arrives.
    Off,
}

pub async fn start(upstream: &str, buffering: Buffering) -> Result<Nginx, String> {
    let version = std::process::Command::new("nginx").arg("-v").output();
    if version.is_err() {
        return Err("nginx is not on the PATH (Debian: apt-get install nginx-light)".into());
    }
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let d = dir.path().display();
    let upstream_host = upstream.trim_start_matches("http://");
    let buffering = match buffering {
        Buffering::Default => "",
        Buffering::Off => "      proxy_buffering off;\n",
    };
    let conf = format!(
        "daemon off;\nworker_processes auto;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream api {{ server {upstream_host}; keepalive 256; }}\n\
           server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://api;\n\
               proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n{buffering}    }}\n  }}\n}}\n"
    );
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf).map_err(|e| e.to_string())?;
    let child = std::process::Command::new("nginx")
        .arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("nginx did not start: {e}"))?;
    let nginx = Nginx { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > deadline {
            return Err("nginx did not listen within 5s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(nginx)
}
