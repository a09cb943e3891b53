//! A check of the joined tier in test builds: device and host copies hold the same bytes.

use super::core::StepScheduler;
use super::PrefixTier;

impl StepScheduler<PrefixTier> {
    /// Test builds, memory of this process: every object with a written host copy and a
    /// device copy (the directory's, or a slot of the device resolver's that the mirror names
    /// for it) holds the same bytes in both (no copy read or wrote the wrong slot).
    pub(crate) fn validate_copies(&self) -> std::result::Result<(), String> {
        use crate::directory::HostState;
        let (dev, host) = (self.xfer.device(), self.xfer.host());
        if dev.kind() == crate::transfer::MemoryKind::Device {
            return Ok(());
        }
        // Mid device step the resolver writes victims' slots before reconcile evicts them
        // (and may be copying now, on another thread): checked between steps only.
        if self.device_step_open() {
            return Ok(());
        }
        let order = self.tier.order();
        let bytes = dev.page_bytes() as usize;
        // The objects the device resolver's slots hold (where the mirror names them), then
        // every home's object on the device.
        let layers = self.cfg.layers as usize;
        let pooled = self.resolver_named().into_iter().map(|(e, slot)| {
            let (h, l) = ((e / layers) as u32, (e % layers) as u16);
            (h, l, Some(slot))
        });
        let homes =
            (0..self.cfg.host_pages).flat_map(|h| (0..self.cfg.layers).map(move |l| (h, l, None)));
        for (h, l, pool_slot) in pooled.chain(homes) {
            let key = self.tier.key_at(h, l);
            let Some(o) = self.dir.state(&key) else {
                continue;
            };
            let device = match pool_slot {
                Some(slot) => crate::directory::DeviceState::Ready { slot },
                None => o.device,
            };
            let (crate::directory::DeviceState::Ready { slot }, HostState::Ready { .. }) =
                (device, o.host)
            else {
                continue;
            };
            for plane in 0..dev.planes_per_layer() {
                let (Some(d), Some(hp)) = (
                    dev.row_addr_checked(plane, slot.raw(), 0),
                    host.row_addr_checked(plane, order.flat(h, l), 0),
                ) else {
                    return Err(format!("{key}: slot {slot:?} or its home out of its pool"));
                };
                // SAFETY: both addresses were bounds-checked against their bindings, which
                // the scheduler keeps alive; a page's bytes lie inside its plane; memory
                // of this process (checked above). No device step is open (checked
                // above: the resolver writes only inside one, and opening one needs the
                // scheduler, which `&self` holds; the resolver's slots are written only
                // then), and an object Ready on both tiers has no copy in flight to or
                // from it; this only reads.
                let same = unsafe {
                    std::slice::from_raw_parts(d as *const u8, bytes)
                        == std::slice::from_raw_parts(hp as *const u8, bytes)
                };
                if !same {
                    return Err(format!(
                        "{key}: device slot {slot:?} and its host copy differ (plane {plane})"
                    ));
                }
            }
        }
        Ok(())
    }
}
