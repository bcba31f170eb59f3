//! Completion status values (NVMe Base 2.0 §4.6.1.2; NVMe-oF 1.1 §3.3 for
//! the Connect-specific ones).

use std::fmt;

/// A completion status: type, code and the Do Not Retry bit.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Status {
    /// Status Code Type (0 generic, 1 command specific, 2 media).
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// Do Not Retry: a permanent failure.
    pub dnr: bool,
}

impl Status {
    const fn new(sct: u8, sc: u8) -> Status {
        Status { sct, sc, dnr: true }
    }

    /// Success.
    pub const SUCCESS: Status = Status {
        sct: 0,
        sc: 0,
        dnr: false,
    };
    /// Invalid Command Opcode (generic 0x01).
    pub const INVALID_OPCODE: Status = Status::new(0, 0x01);
    /// Invalid Field in Command (generic 0x02).
    pub const INVALID_FIELD: Status = Status::new(0, 0x02);
    /// Data Transfer Error (generic 0x04).
    pub const DATA_TRANSFER_ERROR: Status = Status::new(0, 0x04);
    /// Internal Error (generic 0x06).
    pub const INTERNAL_ERROR: Status = Status::new(0, 0x06);
    /// Invalid Namespace or Format (generic 0x0B).
    pub const INVALID_NAMESPACE: Status = Status::new(0, 0x0B);
    /// Command Sequence Error (generic 0x0C).
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::new(0, 0x0C);
    /// Data SGL Length Invalid (generic 0x0F).
    pub const SGL_LENGTH_INVALID: Status = Status::new(0, 0x0F);
    /// SGL Descriptor Type Invalid (generic 0x11).
    pub const SGL_TYPE_INVALID: Status = Status::new(0, 0x11);
    /// SGL Offset Invalid (generic 0x16).
    pub const SGL_OFFSET_INVALID: Status = Status::new(0, 0x16);
    /// Keep Alive Timer Expired (generic 0x19).
    pub const KEEP_ALIVE_EXPIRED: Status = Status::new(0, 0x19);
    /// Keep Alive Timeout Invalid (generic 0x1A).
    pub const KEEP_ALIVE_INVALID: Status = Status::new(0, 0x1A);
    /// LBA Out of Range (generic 0x80).
    pub const LBA_OUT_OF_RANGE: Status = Status::new(0, 0x80);
    /// Asynchronous Event Request Limit Exceeded (command specific 0x05).
    pub const AER_LIMIT_EXCEEDED: Status = Status::new(1, 0x05);
    /// Invalid Log Page (command specific 0x09).
    pub const INVALID_LOG_PAGE: Status = Status::new(1, 0x09);
    /// Connect Incompatible Format (command specific 0x80).
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::new(1, 0x80);
    /// Connect Controller Busy (command specific 0x81).
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::new(1, 0x81);
    /// Connect Invalid Parameters (command specific 0x82).
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::new(1, 0x82);
    /// Connect Invalid Host (command specific 0x84).
    pub const CONNECT_INVALID_HOST: Status = Status::new(1, 0x84);
    /// Write Fault (media 0x80).
    pub const WRITE_FAULT: Status = Status::new(2, 0x80);
    /// Unrecovered Read Error (media 0x81).
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(2, 0x81);

    /// Whether this is success.
    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// The 15-bit status field: DNR (14), SCT (10:8), SC (7:0); a CQE
    /// carries it shifted left past the phase bit.
    pub fn word(self) -> u16 {
        u16::from(self.dnr) << 14 | u16::from(self.sct & 7) << 8 | u16::from(self.sc)
    }

    /// Decode a CQE's status word (phase bit included).
    pub fn from_cqe_word(w: u16) -> Status {
        let w = w >> 1;
        Status {
            sct: (w >> 8 & 7) as u8,
            sc: w as u8,
            dnr: w & 1 << 14 != 0,
        }
    }

    /// A short name for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match (self.sct, self.sc) {
            (0, 0x00) => "success",
            (0, 0x01) => "invalid_opcode",
            (0, 0x02) => "invalid_field",
            (0, 0x04) => "data_transfer_error",
            (0, 0x06) => "internal_error",
            (0, 0x0B) => "invalid_namespace",
            (0, 0x0C) => "command_sequence_error",
            (0, 0x0F) => "sgl_length_invalid",
            (0, 0x11) => "sgl_type_invalid",
            (0, 0x16) => "sgl_offset_invalid",
            (0, 0x19) => "keep_alive_expired",
            (0, 0x1A) => "keep_alive_invalid",
            (0, 0x80) => "lba_out_of_range",
            (1, 0x05) => "aer_limit_exceeded",
            (1, 0x09) => "invalid_log_page",
            (1, 0x80) => "connect_incompatible_format",
            (1, 0x81) => "connect_controller_busy",
            (1, 0x82) => "connect_invalid_parameters",
            (1, 0x84) => "connect_invalid_host",
            (2, 0x80) => "write_fault",
            (2, 0x81) => "unrecovered_read_error",
            _ => "other",
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(sct {}, sc {:#04x}{})",
            self.name(),
            self.sct,
            self.sc,
            if self.dnr { ", dnr" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CQE status words with DNR, as the reference's table lists them.
    #[test]
    fn cqe_words_match_the_table() {
        for (s, w) in [
            (Status::INVALID_OPCODE, 0x8002u16),
            (Status::INVALID_FIELD, 0x8004),
            (Status::INVALID_NAMESPACE, 0x8016),
            (Status::COMMAND_SEQUENCE_ERROR, 0x8018),
            (Status::LBA_OUT_OF_RANGE, 0x8100),
            (Status::INVALID_LOG_PAGE, 0x8212),
            (Status::CONNECT_INVALID_PARAMETERS, 0x8304),
            (Status::CONNECT_INVALID_HOST, 0x8308),
        ] {
            assert_eq!(s.word() << 1, w, "{s:?}");
            assert_eq!(Status::from_cqe_word(w), s);
        }
        assert_eq!(Status::SUCCESS.word(), 0);
    }
}
