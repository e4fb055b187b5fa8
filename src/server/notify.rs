//! Telling systemd how the service stands (`Type=notify`, deploy/idem.service): ready once the
//! store is open and both listeners are bound, stopping once a shutdown starts. Nothing is sent
//! when no service manager asked (`NOTIFY_SOCKET` unset), and a failure to send is only logged:
//! the broker serves either way.

use sd_notify::NotifyState;

/// The broker serves: its store is open and its listeners accept connections.
pub(crate) fn ready() {
    send(&[NotifyState::Ready, NotifyState::Status("serving")]);
}

/// The broker is shutting down: its drain has begun.
pub(crate) fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("draining")]);
}

fn send(states: &[NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "could not tell the service manager how the broker stands");
    }
}
